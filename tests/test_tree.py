import pytest
import torch

from selfspec.tree import DeviceTree, Tree, host_tree


def test_chain_is_a_linear_draft():
    tree = Tree.chain(3)
    assert tree.parents == (-1, 0, 1)
    assert tree.is_chain and tree.num_nodes == 3 and tree.max_depth == 3
    assert tree.depth.tolist() == [1, 2, 3]
    assert torch.equal(tree.ancestor_mask, torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(tree.mask_with_root, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.positions_with_root.tolist() == [0, 1, 2, 3]
    assert tree.paths == ((0, 1, 2),)


def test_empty_chain_is_plain_decoding():
    tree = Tree.chain(0)
    assert tree.num_nodes == 0 and tree.children_of(-1) == ()
    assert tree.mask_with_root.tolist() == [[True]]


def test_from_paths_orders_nodes_and_derives_structure():
    tree = Tree.from_paths([[0, 1], [1], [0], [0, 0], [1, 0], [0, 0, 0]])
    assert tree.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert tree.parents == (-1, -1, 0, 0, 1, 2)
    assert tree.children_of(-1) == (0, 1) and tree.children_of(0) == (2, 3)
    assert tree.depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert tree.leaves == (3, 4, 5)
    assert tree.paths == ((0, 3), (1, 4), (0, 2, 5))
    assert tree.retrieve_indices.tolist() == [[0, 3, -1], [1, 4, -1], [0, 2, 5]]
    assert tree.positions_with_root.tolist() == [0, 1, 1, 2, 2, 2, 3]


def test_ancestor_mask_is_self_plus_ancestors():
    tree = Tree.from_parents([-1, -1, 0, 0, 1, 2])
    mask = tree.ancestor_mask
    for i in range(tree.num_nodes):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path_to(i))
    full = tree.mask_with_root
    assert full[:, 0].all() and not full[0, 1:].any()


def test_from_parents_assigns_sibling_ranks():
    tree = Tree.from_parents([-1, -1, 1, 1, 0])
    assert tree.choices == ((0,), (1,), (1, 0), (1, 1), (0, 0))


def test_not_topologically_ordered_is_a_clear_error():
    with pytest.raises(ValueError, match="topological order"):
        Tree.from_parents([-1, 2, 0])
    with pytest.raises(ValueError, match="topological order"):
        Tree.from_parents([0])


def test_from_paths_needs_every_prefix():
    with pytest.raises(ValueError, match="no parent path"):
        Tree.from_paths([[0], [1, 0]])
    with pytest.raises(ValueError, match="non-empty"):
        Tree.from_paths([[]])


@pytest.mark.parametrize("seed", range(20))
def test_a_device_tree_gives_the_trees_verification_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 24, (), generator=g))
    parents = [int(torch.randint(-1, i, (), generator=g)) if i else -1 for i in range(n)]
    tree = Tree.from_parents(parents)
    device_tree = DeviceTree(torch.tensor(parents, dtype=torch.long), max(tree.max_depth, 1))
    positions, mask = device_tree.verification_inputs("cpu")
    assert torch.equal(positions, tree.positions_with_root)
    assert torch.equal(mask, tree.mask_with_root)
    assert host_tree(device_tree) is tree and host_tree(tree) is tree


def test_a_device_tree_needs_hops_to_its_depth():
    """The mask holds a node's whole path only after max_depth_bound hops: a bound too low
    misses the root's grandchildren's grandparent (the test above would catch such a bug)."""
    tree = Tree.chain(3)
    _, mask = DeviceTree(torch.tensor(tree.parents), 1).verification_inputs("cpu")
    assert not torch.equal(mask, tree.mask_with_root)


@pytest.mark.parametrize("seed", range(20))
def test_a_device_tree_lists_the_children_its_valid_nodes_have_on_the_host(seed):
    """`children_table` by tensor ops equals the host tree's, with the rows that are not nodes
    (a node invalid makes its subtree invalid) left out and the table as wide as the bound."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 24, (), generator=g))
    parents = [int(torch.randint(-1, i, (), generator=g)) if i else -1 for i in range(n)]
    valid = []
    for parent in parents:
        valid.append(bool(torch.rand((), generator=g) < 0.8) and (parent < 0 or valid[parent]))
    tree, rows = DeviceTree(torch.tensor(parents), n).nodes_on_host(parents, valid)
    kept = Tree.from_parents(parents).children_table("cpu")  # every node valid
    bound = max(Tree.from_parents(parents).max_children, 1)
    device_tree = DeviceTree(torch.tensor(parents), n, max_children_bound=bound)
    assert torch.equal(device_tree.children_table("cpu"), kept)
    table = DeviceTree(torch.tensor(parents), n, torch.tensor(valid), bound
                       ).children_table("cpu")
    expected = torch.full((n + 1, bound), -1)
    for node in (-1, *rows):  # each valid node's children, by their rows of the draft
        at = 0 if node < 0 else rows.index(node) + 1
        kids = [rows[c] for c in tree.children[at]]
        expected[node + 1, :len(kids)] = torch.tensor(kids, dtype=torch.long)
    assert torch.equal(table, expected)


def test_a_tree_lists_each_nodes_children_in_order():
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 2]])
    assert tree.max_children == 3
    assert tree.children_table("cpu").tolist() == [[0, 1, -1], [2, 3, 4], [-1] * 3,
                                                   [-1] * 3, [-1] * 3, [-1] * 3]
    assert Tree.chain(0).children_table("cpu").tolist() == [[-1]]
