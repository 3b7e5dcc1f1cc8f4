"""benchmarks/_harness.PowerLog: the medians it reports from nvidia-smi's samples, through a stand-in
nvidia-smi on PATH (a script printing what the real one prints with -lms, then waiting to be
terminated), and its answer where nvidia-smi is absent."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _harness import PowerLog  # noqa: E402


def _fake_smi(tmp_path, lines: list[str]) -> None:
    script = tmp_path / "nvidia-smi"
    body = "".join(f"echo '{line}'\n" for line in lines)
    script.write_text(f"#!/bin/sh\n{body}exec sleep 30\n")
    script.chmod(0o755)


def test_power_log_reports_the_medians_past_the_ramp_up(tmp_path, monkeypatch):
    # 16 samples: the first two (an eighth) are the ramp-up at idle clocks and must not count; an
    # "[N/A]" sample (as nvidia-smi prints while a reading is unavailable) is skipped
    samples = ["345, 81.5", "600, 150.0"] + [f"{1300 + 10 * i}, {680 + i}.0" for i in range(13)] + ["[N/A], [N/A]"]
    _fake_smi(tmp_path, samples)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with PowerLog() as log:
        import time
        time.sleep(0.5)  # the stand-in prints at once; the real one every interval
    assert log.error is None and log.samples == 13
    assert (log.clock_mhz, log.power_w) == (1360.0, 686.0)
    assert log.summary() == "1360 MHz, 686 W (13 samples)"


def test_power_log_says_when_nvidia_smi_is_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with PowerLog() as log:
        pass
    assert log.summary() == "nvidia-smi not found" and log.samples == 0
