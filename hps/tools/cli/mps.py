"""`hps mps start|status|stop`: NVIDIA's MPS control daemon for the processes of a GPU host
(hps/runtime/mps.py), so that several processes' kernels run side by side rather than in
time slices. Every process that should use it needs the same CUDA_MPS_PIPE_DIRECTORY."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hps.errors import HPSError
from hps.tools.cli.root import HELP_OPTIONS, console, fail

mps_app = typer.Typer(add_completion=False, rich_markup_mode=None,
                      context_settings=HELP_OPTIONS, no_args_is_help=True,
                      help="NVIDIA's MPS control daemon for the processes of a GPU host: "
                           "start, status, stop.")

_PIPE = typer.Option(None, "--pipe-dir", help="The daemon's pipe directory (default: "
                     "$CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps, the driver's).")


def _pipe_dir(given: Optional[Path]) -> Path:
    from hps.runtime import mps

    return given or mps.pipe_directory()


@mps_app.command("start")
def mps_start(pipe_dir: Optional[Path] = _PIPE,
              log_dir: Optional[Path] = typer.Option(
                  None, "--log-dir", help="Its log directory (default: "
                  "$CUDA_MPS_LOG_DIRECTORY, else /var/log/nvidia-mps as root, else "
                  "PIPE_DIR-log).")) -> None:
    """Start the daemon (nvidia-cuda-mps-control -d), then print the line the processes
    need. Exit 2 when it is missing or already running there."""
    from hps.runtime import mps

    pipes = _pipe_dir(pipe_dir)
    logs = log_dir or mps.log_directory(pipes)
    try:
        mps.start(pipes, logs)
    except HPSError as exc:
        fail(exc)
    console.print(f"MPS control daemon started (pipes {pipes}, log {logs}); start the GPU "
                  f"processes with:\n  export CUDA_MPS_PIPE_DIRECTORY={pipes}",
                  highlight=False, markup=False)


@mps_app.command("status")
def mps_status(pipe_dir: Optional[Path] = _PIPE) -> None:
    """Say whether a daemon runs there: exit 0 if it does, 1 if not."""
    from hps.runtime import mps

    pipes = _pipe_dir(pipe_dir)
    if mps.found_in(pipes):
        console.print(f"running ({pipes})", highlight=False, markup=False)
        return
    console.print(f"not running ({pipes}): {_how_to_start(pipe_dir)}", highlight=False,
                  markup=False)
    raise typer.Exit(1)


def _how_to_start(pipe_dir: Optional[Path]) -> str:
    """The step that starts a daemon here, as it runs when pasted: `hps mps start` (with
    the pipe directory that was asked about) where the control program is on PATH, else
    what to install first, since `hps mps start` would only fail for want of it."""
    import shlex
    import shutil

    from hps.runtime.mps import CONTROL

    command = "hps mps start" + (f" --pipe-dir {shlex.quote(str(pipe_dir))}" if pipe_dir else "")
    if shutil.which(CONTROL) is not None:
        return f"`{command}` starts it"
    return (f"{CONTROL} is not on PATH, so `{command}` cannot start one: install NVIDIA's "
            "driver utilities first (Debian and Ubuntu: the nvidia-compute-utils-VERSION "
            "package of the driver's version; in a container, NVIDIA_DRIVER_CAPABILITIES "
            "with compute and utility), or run this on the GPU host")


@mps_app.command("stop")
def mps_stop(pipe_dir: Optional[Path] = _PIPE,
             timeout: float = typer.Option(10.0, "--timeout", min=0.1,
                                           help="Seconds to wait for it to quit.")) -> None:
    """Ask the daemon to quit, waiting at most --timeout seconds (its quit can hang).
    Exit 1 if none runs there, 2 if it did not quit in time."""
    from hps.runtime import mps

    pipes = _pipe_dir(pipe_dir)
    if not mps.found_in(pipes):
        console.print(f"not running ({pipes})", highlight=False, markup=False)
        raise typer.Exit(1)
    try:
        mps.stop(pipes, timeout)
    except HPSError as exc:
        fail(exc)
    console.print(f"MPS control daemon stopped ({pipes})", highlight=False, markup=False)
