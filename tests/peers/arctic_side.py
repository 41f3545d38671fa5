"""arctic-inference's side of tests/peers/test_arctic_suffix.py, run with the python of the
venv `scripts/peers.sh arctic` builds: its own SuffixDecodingCache replays a script of requests
and writes each speculation.

Usage: arctic_side.py SCRIPT.json OUT.json. The script: {"max_tree_depth", "settings": {...},
"ops": [["start", req, prompt] | ["add", req, tokens] | ["speculate", req, context] |
["stop", req]]}; OUT: one {"tokens", "parents", "probs", "score", "match_len"} per speculate.
"""

import json
import sys

from arctic_inference.suffix_decoding import SuffixDecodingCache


def main(script_path: str, out_path: str) -> None:
    with open(script_path) as f:
        script = json.load(f)
    cache = SuffixDecodingCache(max_tree_depth=script["max_tree_depth"])
    settings = script["settings"]
    drafts = []
    for op, req, *args in script["ops"]:
        if op == "start":
            cache.start_request(req, args[0])
        elif op == "add":
            cache.add_active_response(req, args[0])
        elif op == "stop":
            cache.stop_request(req)
        else:
            draft = cache.speculate(req, args[0], **settings)
            drafts.append({"tokens": list(draft.token_ids), "parents": list(draft.parents),
                           "probs": list(draft.probs), "score": draft.score,
                           "match_len": draft.match_len})
    with open(out_path, "w") as f:
        json.dump(drafts, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
