"""How every tfm program ends: the `tfm` commands and the scripts in scripts/ alike. A user's error
is one line on stderr and exit 2, Ctrl-C 130, SIGTERM 143, SIGHUP 129, a closed output pipe a quiet
0; never a traceback (docs/reliability.md)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from .console import discard_writes, warn
from .errors import Diverged, Interrupted, TfmError, describe_os_error
from .signals import Terminated, terminate_like_ctrl_c


@contextlib.contextmanager
def user_errors_in_one_line() -> Iterator[None]:
    """Within this block SIGTERM and SIGHUP stop like Ctrl-C, and what stops the work ends the
    process with one line and its exit code (SystemExit)."""
    try:
        with terminate_like_ctrl_c():
            yield
    except TfmError as err:
        warn(f"error: {err}")
        raise SystemExit(2) from None
    except Interrupted as stop:  # Diverged too
        if str(stop):  # torchrun's other ranks stop silently: rank 0 has said it
            warn(f"error: {stop}" if isinstance(stop, Diverged) else str(stop))
        raise SystemExit(stop.exit_code) from None
    except KeyboardInterrupt:
        warn("interrupted")
        raise SystemExit(130) from None
    except Terminated as stop:
        warn(f"{stop}: stopped")
        raise SystemExit(stop.exit_code) from None
    except BrokenPipeError:
        # Downstream closed the pipe (`tfm translate | head`): stop quietly.
        discard_writes([sys.stdout.fileno()])  # Python's flush at exit would fail again
        raise SystemExit(0) from None
    except OSError as exc:
        # Disk full, read-only or unwritable directories, file-size limits: name the path and cause.
        warn(f"error: {describe_os_error(exc)}")
        raise SystemExit(2) from None
    except MemoryError:
        warn("error: out of memory (use smaller batches: train.max_tokens / decode.batch_size)")
        raise SystemExit(2) from None


def run_script(main: Callable[[], Any]) -> None:
    """A script's `main()` under the same rules as a `tfm` command."""
    with user_errors_in_one_line():
        main()


class ScriptParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like tfm's: `error: <script>: <what> (see --help)`,
    exit 2 (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        warn(f"error: {self.prog}: {message} (see {self.prog} --help)")
        raise SystemExit(2)
