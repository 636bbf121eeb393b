"""One run: its typed config, its directory, its lock and its checkpoints.

config.py reads YAML and `--set` overrides into the pydantic `ExperimentConfig` that every command
is built from (YAML → typed config → builders); directions.py the language directions of a
multilingual run; shapes.py the named model shapes (model.size) and their measured curves;
scoring.py how a search scores a hypothesis (length penalties, normalisation, the stopping rule);
rundir.py the run directory's layout (the one place that knows where each file
lies); runlock.py the lock one writer holds; checkpoint.py writing and reading checkpoints
(plain tensors and primitives, `weights_only=True`) and the model a checkpoint builds.

Entry points: `config.load_config`, `config.config_from_dict`, `rundir.RunDirectory`,
`checkpoint.load_trained_model`.
May import: the model and runtime wings.
"""
