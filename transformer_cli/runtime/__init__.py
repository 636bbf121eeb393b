"""The process and the machine: what every stage stands on.

errors.py (TfmError: the one-line error every command ends with), entry.py (how every command and
script ends: one error line, its exit code), files.py (atomic writes, staging directories, output
protection), console.py (stdout/stderr), signals.py (SIGTERM and SIGINT as one interruption;
children that die with their parent), cpu.py and devices.py (cores, CPU features, CUDA,
out-of-memory), precision.py (fp32, bf16 or int8, measured per CPU), allocator.py (restarting
`tfm train` on mimalloc).

Entry points: `errors.TfmError`, `entry.user_errors_in_one_line`, `files.atomic_write_text`,
`devices.resolve_device`, `precision.choose_precision`.
May import: the model wing (kernel choices, CPU layouts) and the package root's constants.
"""
