"""The composition root, and the only package that reads configs: it turns the Hydra config
tree (conf/) into library objects.

Entry points import what they call from the module that defines it (`from
selfspec.from_config.models import load_target`) and stay short; everything below them takes
plain values. This package re-exports nothing.
One module per concern: `common` (paths, checked settings, devices), `models` (weights and
tokenizers; the target's settings read once into a `TargetSpec` for `selfspec.model.loading`),
`prompts`, `methods/` (the method registry: one module per method, holding its registry entry
(its variants, checks, what it loads, its drafter) and, for a method that trains, its trainer
entry (its settings checked, its fresh module, its objective, its export and the export's
drafters, its report)), `generation` (eval/generate.py's drafter), `training` (what every
trainer shares), `train_method` (the one `main` of train/<method>.py), `features` (feature
stores) and `sweeps`.
"""
