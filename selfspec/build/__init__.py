"""The only package that reads configs: turns the Hydra config tree (conf/) into library objects.

Entry points call `build.<function>` and stay short; everything below them takes plain values.
One module per concern: `common` (paths, checked settings, devices), `models` (weights and
tokenizers), `prompts`, `drafters` (heads, trees, drafters), `training` and `sweeps`.
"""

from selfspec.build.common import (  # noqa: F401
    CONF_DIR,
    REPO_ROOT,
    as_list,
    checked_settings,
    device,
    positive_int,
    sampling_params,
    set_threads,
)
from selfspec.build.drafters import (  # noqa: F401
    DRAFTERS,
    EAGLE_VERSIONS,
    build_drafter,
    check_eagle_settings,
    check_medusa_settings,
    check_medusa_tree,
    drafter_choice,
    eagle_config,
    eagle_drafter,
    eagle_head,
    eagle_version,
    generation_settings,
    load_eagle,
    load_medusa,
    lora_settings,
    medusa_config,
    medusa_drafter,
    medusa_heads,
    medusa_version,
    tree_depth,
)
from selfspec.build.models import (  # noqa: F401
    DTYPES,
    TOKENIZER_FILES,
    ModelNotAvailable,
    check_architecture,
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
from selfspec.build.prompts import (  # noqa: F401
    data_path,
    encode_prompt_texts,
    load_prompts,
    prompts,
    stop_ids,
    sweep_prompt_texts,
)
from selfspec.build.sweeps import (  # noqa: F401
    BASELINE_MODES,
    DEFAULT_SWEEP_METHODS,
    SweepModels,
    SweepPlan,
    bench_settings,
    build_method,
    check_sweep_weights,
    draft_lengths,
    floor_settings,
    load_sweep_models,
    medusa_depth,
    named_samplings,
    plan_sweep,
    sweep_methods,
    timing_models,
)
from selfspec.build.training import (  # noqa: F401
    RESUMABLE_CHANGES,
    compare_on_final_eval,
    deepspeed_config,
    distilled_corpus,
    eagle_draft_vocab,
    eagle_objective,
    final_eval_prompts,
    medusa_objective,
    record_run_config,
    report_due,
    run_tracker,
    self_distill_enabled,
    start_training,
    train_settings,
    training_rows,
)
