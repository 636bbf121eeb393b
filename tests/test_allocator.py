"""`tfm train` runs on mimalloc where it is installed (a dependency on Linux), or on the C library's
malloc when the config asks; the process that trains is the one the user started, with its arguments."""

import os
import subprocess
import sys

import pytest

from transformer_cli.runtime import allocator
from transformer_cli.runtime.errors import TfmError

from .conftest import tfm, tiny_run

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux's")


@linux_only
def test_mimalloc_is_installed_with_tfm():
    library = allocator.mimalloc_library()
    assert library is not None and library.name.startswith("libmimalloc.so")


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("choice, expected", [("auto", "mimalloc"), ("mimalloc", "mimalloc"), ("system", "system")])
def test_tfm_train_runs_on_the_allocator_the_config_picks(tiny_prepared, tmp_path, choice, expected):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=10, eval_every=10)
    proc = tfm("train", "--config", config, "--set", f"train.allocator={choice}")
    assert proc.returncode == 0, proc.stderr
    # what the training process reads from its own memory map (/proc/self/maps), not what it was asked
    assert f"memory allocator: {expected} (train.allocator: {choice})" in proc.stderr
    assert "step 10:" in proc.stderr and (tmp_path / "run/checkpoints/checkpoint_best.pt").is_file()


def test_asking_for_mimalloc_where_it_is_missing_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(allocator, "mimalloc_library", lambda: None)
    monkeypatch.delenv(allocator.RELAUNCHED, raising=False)
    if allocator.loaded_allocator() == "mimalloc":
        pytest.skip("this test process itself runs on mimalloc")
    with pytest.raises(TfmError, match="train.allocator: mimalloc is not installed"):
        allocator.use_allocator("mimalloc", ["-m", "transformer_cli", "train"])
    # auto falls back to the system's malloc: returns
    allocator.use_allocator("auto", ["-m", "transformer_cli", "train"])


@pytest.mark.parametrize("user, expected", [
    ({}, "16384 None /lib/libmimalloc.so -1"),  # tfm's own kernel-cache setting stays behind
    ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LD_PRELOAD": "/lib/other.so", "MIMALLOC_PURGE_DELAY": "5"},
     "64 64 /lib/libmimalloc.so /lib/other.so 5"),
])
def test_the_process_started_again_sees_the_users_environment_not_what_tfm_set(user, expected):
    code = ("import os, pathlib, transformer_cli.runtime.allocator as a; "
            "e = a.relaunch_environment(pathlib.Path('/lib/libmimalloc.so')); "
            "print(os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), e.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'), "
            "e['LD_PRELOAD'], e['MIMALLOC_PURGE_DELAY'], e[a.RELAUNCHED])")
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LD_PRELOAD", "MIMALLOC_PURGE_DELAY")}
    out = subprocess.run([sys.executable, "-c", code], env={**env, **user}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [*expected.split(), "1"]


@linux_only
@pytest.mark.slow
def test_a_library_the_loader_cannot_preload_is_an_error_only_when_asked_for(tiny_prepared, tmp_path):
    config = tiny_run(tiny_prepared, tmp_path, max_steps=2, eval_every=2)
    broken = tmp_path / "libmimalloc.so"
    broken.write_bytes(b"not a shared library")
    env = {**os.environ, "LD_PRELOAD": str(broken), allocator.RELAUNCHED: "1"}  # as if tfm had started again
    proc = tfm("train", "--config", config, "--set", "train.allocator=mimalloc", env=env)
    assert proc.returncode == 2 and "error: train.allocator: mimalloc could not be preloaded" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = tfm("train", "--config", config, env=env)  # auto: goes on, on the system's malloc
    assert proc.returncode == 0 and "memory allocator: system (train.allocator: auto)" in proc.stderr
