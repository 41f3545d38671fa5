"""The composition root, and the only package that reads configs: it turns the Hydra config
tree (conf/) into library objects.

Entry points call `from_config.<function>` and stay short; everything below them takes plain
values.
One module per concern: `common` (paths, checked settings, devices), `models` (weights and
tokenizers), `prompts`, `methods/` (the method registry: one module per method, holding its
registry entry (its variants, checks, what it loads, its drafter) and, for a method that
trains, its trainer entry (its settings checked, its fresh module, its objective, its export
and the export's drafters, its report)), `generation` (eval/generate.py's drafter), `training`
(what every trainer shares), `train_method` (the one `main` of train/<method>.py), `features`
(feature stores) and `sweeps`.
"""

from selfspec.from_config.common import (  # noqa: F401
    CONF_DIR,
    REPO_ROOT,
    as_list,
    checked_settings,
    device,
    positive_int,
    sampling_params,
    set_threads,
)
from selfspec.from_config.features import (  # noqa: F401
    build_feature_store,
    store_layers,
    trainer_features,
)
from selfspec.from_config.generation import (  # noqa: F401
    build_drafter,
    drafter_and_target,
    drafter_choice,
    generation_settings,
)
from selfspec.from_config.methods import (  # noqa: F401
    entry,
    method_names,
    registry,
    trainer,
    trainers,
)
from selfspec.from_config.methods.dflash import (  # noqa: F401
    check_dflash_settings,
    dflash_config,
    dflash_drafter,
    dflash_drafters,
    dflash_head,
    dflash_objective,
    dflash_trainer_drafter,
    load_dflash,
)
from selfspec.from_config.methods.eagle import (  # noqa: F401
    EAGLE_VERSIONS,
    check_eagle_settings,
    eagle_config,
    eagle_drafter,
    eagle_drafters,
    eagle_head,
    eagle_objective,
    eagle_trainer_drafter,
    eagle_version,
    load_eagle,
)
from selfspec.from_config.methods.early_exit import (  # noqa: F401
    check_early_exit_settings,
    early_exit_drafter,
    early_exit_drafters,
    early_exit_heads,
    early_exit_layers,
    early_exit_objective,
    early_exit_thresholds,
    early_exit_trainer_drafter,
    load_early_exit,
    norm_exit,
)
from selfspec.from_config.methods.entry import head_folder  # noqa: F401
from selfspec.from_config.methods.medusa import (  # noqa: F401
    check_medusa_settings,
    check_medusa_tree,
    load_medusa,
    lora_settings,
    medusa_config,
    medusa_drafter,
    medusa_drafters,
    medusa_heads,
    medusa_objective,
    medusa_version,
    tree_depth,
)
from selfspec.from_config.methods.ngram import corpus_path  # noqa: F401
from selfspec.from_config.methods.small_model import (  # noqa: F401
    check_draft_model_settings,
    draft_from_target,
    draft_model_drafters,
    draft_model_mask,
    draft_model_objective,
    freeze_draft_embeddings,
    read_pard,
    small_model_drafter,
    write_pard,
)
from selfspec.from_config.models import (  # noqa: F401
    DTYPES,
    TOKENIZER_FILES,
    ModelNotAvailable,
    compile_steps,
    draft_model_config,
    load_hf_model,
    load_model,
    load_target,
    load_tokenizer,
    model_config,
    model_plan,
    random_models,
    resolve_model_path,
    torch_dtype,
)
from selfspec.from_config.prompts import (  # noqa: F401
    data_path,
    encode_prompt_texts,
    load_prompts,
    prompt_set,
    prompts,
    stop_ids,
    sweep_prompt_texts,
)
from selfspec.from_config.sweeps import (  # noqa: F401
    BASELINE_MODES,
    SweepPlan,
    bench_settings,
    build_method,
    cuda_graphs,
    draft_lengths,
    floor_settings,
    load_sweep_models,
    longest_forward,
    method_colors,
    named_samplings,
    our_drafter,
    plan_sweep,
    size_chooser,
    split_time,
    sweep_cost_profile,
    sweep_dry_run,
    sweep_methods,
    timing_models,
    verified_target,
)
from selfspec.from_config.train_method import train_method  # noqa: F401
from selfspec.from_config.training import (  # noqa: F401
    RESUMABLE_CHANGES,
    check_kept_run,
    compare_on_final_eval,
    deepspeed_config,
    distilled_corpus,
    final_eval_prompts,
    record_run_config,
    report_and_finish,
    report_due,
    run_tracker,
    self_distill_enabled,
    start_training,
    tau_judge,
    tau_prompts,
    train_settings,
    training_rows,
)
