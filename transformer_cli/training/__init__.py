"""Stage 3, training: a prepared run in, checkpoints out.

train.py is `tfm train`: one loop a reader can follow (teacher forcing, warm-up schedule, label
smoothing, evaluation, checkpoints, resume); the plumbing around it lives beside it: builders.py
(the model and optimizer a config builds), shape_choice.py (model.size auto), schedule.py
(learning rates), loss.py (label-smoothed cross-entropy), validation.py (valid loss and BLEU),
final_models.py (averaged, EMA and best checkpoints), ema.py, step_health.py (non-finite steps),
distributed.py (torchrun DDP), master_weights.py, tensorboard_log.py, filter_models.py (the models
`tfm prepare`'s model filter trains on the corpus itself when none is named).

Entry points: `train.train`, `filter_models.train_filter_models`.
May import: the model, runtime, experiment, interop, data and decoding wings (validation translates).
"""
