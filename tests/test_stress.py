"""The stress check, short: threads and processes against one served engine, every answer checked.

``benchmarks/stress.py`` runs it for a minute (``--seconds 60``); here it runs for
a few seconds so that the suite keeps it honest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

STRESS = Path(__file__).resolve().parents[1] / "benchmarks" / "stress.py"


def test_threads_and_processes_against_one_engine_lose_nothing_and_match_single_callers():
    # Its own process group: the server and workers it starts end with it, whatever happens.
    process = subprocess.Popen(
        [sys.executable, str(STRESS), "--seconds", "6", "--threads", "2", "--processes", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    assert process.returncode == 0, output
    assert "stress: OK" in output and " 0 differed from their single-caller reference, 0 failed" in output
