"""Run the launcher's command line in this process once per row of a JSON list, recording what each did: its exit
code, its output, and whether any backend was asked to start (it is told not to: a start is recorded, nothing runs).
One process for a whole table of commands (the catalogue of mistakes, tests/conformance/test_mistakes.py; the docs'
commands, tests/test_docs.py): a row costs its composition and checks, not a Python and torch start each.

    python commands.py ROWS.json RESULTS.json [--no-forecast]   (in the project directory the rows are written for)

--no-forecast: a dry run prints no memory forecast (two rank processes each, ~4 s; tests/test_forecast.py tests them).

A row: {"id": ..., "args": [...]}; a result: {"id", "code", "stdout", "stderr", "started", "seconds"}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback


def main(rows_file: str, results_file: str, *options: str) -> None:
    sys.path[0] = os.getcwd()  # as under `python -m launcher`: the project's modules, not this file's folder
    from hydra.core.global_hydra import GlobalHydra

    import launcher.main
    from launcher.__main__ import compose_and_launch

    started: list[str] = []
    get_backend = launcher.main.get_backend

    def recording(name: str):
        backend = get_backend(name)
        backend.start = lambda *args, **kwargs: started.append(name) or 0  # the instance's own: nothing runs
        return backend

    launcher.main.get_backend = recording
    if "--no-forecast" in options:
        launcher.main.dry_run_forecast = lambda cfg, snapshot: (["forecast  not made (--no-forecast)"], None)
    results = []
    for row in json.loads(open(rows_file).read()):
        GlobalHydra.instance().clear()
        started.clear()
        out, err = io.StringIO(), io.StringIO()
        sys.argv = ["launcher", *row["args"]]
        began = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                compose_and_launch()
                code = 0
            except SystemExit as end:
                code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
            except BaseException:  # noqa: BLE001 - a traceback is a result of its own: the row shows it
                traceback.print_exc()
                code = "traceback"
        results.append({"id": row["id"], "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                        "started": bool(started), "seconds": round(time.perf_counter() - began, 2)})
    with open(results_file, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
