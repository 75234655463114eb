"""Entry points run as ``python SCRIPT ARGS...`` runs them, each in a process of its own, forked
from one that has already imported torch.

Importing torch is most of a refused command's time (~1.8 s of 2.3-2.8 s on a 2-core machine), and
test_bad_input.py runs over a hundred of them. Here a server process imports torch once; for each
command it forks a child that sets the working directory, ``sys.argv``, ``sys.path[0]`` (the
script's folder) and standard streams as the interpreter would, runs the script as ``__main__``
(runpy), and exits as the interpreter exits: the code of a ``SystemExit``, or 1 after printing an
uncaught exception's traceback, after non-daemon threads and ``atexit`` functions. What the script
imports beyond torch, and everything it does, happens in the child, so a command that writes a file
or runs a hostile pickle does so in its own process, as from the command line.

    with Prefork(env) as run:
        proc = run(script, argv, cwd=folder, timeout=600)   # a subprocess.CompletedProcess

The server reads one JSON request a line on its stdin and answers with one on its stdout; one
command at a time (use one Prefork per concurrent worker).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


class Prefork:
    def __init__(self, env: dict) -> None:
        self.env = env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Prefork":
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, text=True)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)

    def __call__(self, script: str | Path, argv: list, cwd: str | Path,
                 timeout: float = 600) -> subprocess.CompletedProcess:
        """``subprocess.run([python, script, *argv], cwd=cwd, capture_output=True, text=True,
        timeout=timeout)`` with stdin empty, forked from the server."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = dict(script=str(script), argv=[str(a) for a in argv], cwd=str(cwd), stdout=out,
                           stderr=err, timeout=timeout)
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the prefork server exited (rc {self.proc.poll()})")
            answer = json.loads(line)
            args = [sys.executable, str(script), *request["argv"]]
            if answer.get("timeout"):
                raise subprocess.TimeoutExpired(args, timeout)
            return subprocess.CompletedProcess(args, answer["rc"], Path(out).read_text(errors="replace"),
                                               Path(err).read_text(errors="replace"))


def _child(request: dict) -> None:
    """Run one script as the interpreter would, then leave the process: never returns."""
    import atexit
    import runpy
    import threading
    import traceback

    code = 1
    try:
        os.chdir(request["cwd"])
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        # A new reader of fd 0: the server's may hold what it read ahead of its requests.
        sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), encoding=sys.stdin.encoding,
                                     errors=sys.stdin.errors)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        script = os.path.abspath(request["script"])
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(script)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _serve() -> None:
    import signal
    import time

    import torch  # noqa: F401  (the import every child shares)

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        deadline, status = time.monotonic() + request["timeout"], None
        while status is None:
            done, waited = os.waitpid(pid, os.WNOHANG)
            if done:
                status = waited
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print(json.dumps({"timeout": True}), flush=True)
                break
            else:
                time.sleep(0.01)
        else:
            print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
