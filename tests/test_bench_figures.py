"""Benchmark figures never come out NaN or infinite: over an empty sample they are null with a reason
(rollway.base.figures), and every `rollway bench` result is written through a JSON writer that refuses
NaN and infinity."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollway.base import figures
from rollway.bench.cmd_bench import _emit
from rollway.bench.real import Sampler, format_real_text


def test_figures_over_empty_or_zero_samples_are_none():
    assert figures.mean([]) is None and figures.mean([float("nan"), None]) is None and figures.mean([1, 3]) == 2
    assert figures.ratio(1, 0) is None and figures.ratio(None, 2) is None and figures.ratio(float("inf"), 2) is None
    assert figures.ratio(0, 4) == 0 and figures.ratio(3, 2) == 1.5
    assert figures.percentile([], 50) is None and figures.percentile([5, 1, 3], 50) == 3
    assert figures.percentile([float("nan"), 2.0], 99) == 2.0
    assert figures.scaled(1000, None) is None and figures.scaled(1000, 0.5) == 500
    out: dict = {}
    figures.put(out, "a", 1.0, "unused")
    figures.put(out, "b", None, "no sample")
    figures.put(out, "c", float("nan"), "nan in")
    assert out == {"a": 1.0, "b": None, "c": None, "no_sample": {"b": "no sample", "c": "nan in"}}
    assert figures.fmt(None) == "n/a" and figures.fmt(0.123) == "0.12"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_result_writer_refuses_nan_and_infinity_and_names_the_figure(tmp_path, bad):
    """The output boundary of every `rollway bench` command: a result holding NaN/inf is not written (json.dumps
    alone writes the non-JSON token NaN); the error names where it is."""
    result = {"baseline": {"engine_mean_running": bad, "ok": 1.0}, "series": [1.0, {"x": 2.0}]}
    with pytest.raises(figures.NonFiniteFigure, match=r"result\.baseline\.engine_mean_running"):
        _emit(result, tmp_path, True, str)
    assert not (tmp_path / "result.json").exists()
    _emit({"baseline": {"engine_mean_running": None, "no_sample": {"engine_mean_running": "why"}}}, tmp_path, True, str)
    assert json.loads((tmp_path / "result.json").read_text())["baseline"]["engine_mean_running"] is None


class _SlowEveryOtherMetrics(BaseHTTPRequestHandler):
    """An engine's /metrics that answers every other scrape after 2.5 s: past the sampler's 2 s limit, as a
    vLLM server on a busy machine did."""

    calls = 0
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802
        with self.lock:
            type(self).calls += 1
            slow = self.calls % 2 == 0
        if slow:
            time.sleep(2.5)
        body = b"vllm:num_requests_running{model_name=\"m\"} 1.0\nvllm:num_requests_waiting{model_name=\"m\"} 0.0\n"
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the sampler gave up on this scrape

    def log_message(self, *args):
        pass


def test_engine_figures_leave_out_failed_scrapes_instead_of_turning_nan():
    """The cause of `engine_mean_running: NaN` in `bench pipeline --real` (issue 44): a /metrics scrape that
    timed out entered the mean as NaN. A real sampler thread against a real HTTP endpoint that answers every
    other scrape too late: the engine's figures are over the scrapes that answered, the failed ones are
    counted, and the result goes through the JSON writer."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowEveryOtherMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sampler = Sampler(f"http://127.0.0.1:{server.server_address[1]}/metrics", None, 0.05)
    try:
        t0 = time.time()
        sampler.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                sum(s[1] is None for s in sampler.samples) >= 1 and sum(s[1] is not None for s in sampler.samples) >= 2):
            time.sleep(0.1)
        sampler.stop()
        w = sampler.window(t0, time.time())
    finally:
        server.shutdown()
    assert w["engine_mean_running"] == 1.0 and w["engine_busy_fraction"] == 1.0 and w["engine_mean_waiting"] == 0.0
    assert w["engine_scrapes_failed"] >= 1 and w["samples"] > w["engine_scrapes_failed"]
    assert figures.non_finite_paths(w) == [] and json.loads(figures.dumps(w))["engine_mean_running"] == 1.0


def test_the_real_bench_text_report_says_n_a_with_the_reason():
    """A mode whose engine figures had no sample prints n/a and why, not nan."""
    mode = {"makespan_s": 3.0, "turns": 2, "generated_tokens": 10, "generated_tokens_per_s": 10 / 3, "resolved": 0,
            "episodes": 2, "seconds_per_episode": {"init": 1.0, "agent_gen": 1.0, "agent_tool": 0.0, "reward": 1.0},
            "stop_reasons": {"max_turns": 2}, "samples": 0}
    figures.put(mode, "engine_mean_running", None, "no sample in the window")
    figures.put(mode, "engine_busy_fraction", None, "no sample in the window")
    result = {"config": {"num_tasks": 1, "group_size": 2, "epochs": 1, "slots": 2}, "episodes": 2,
              "tasks_path": "t.jsonl", "engine_start_s": 0.0, "pipeline": mode, "out_dir": "o"}
    text = format_real_text(result)
    assert "nan" not in text.lower() and "busy n/a, running n/a" in text
    assert "engine_mean_running: n/a, no sample in the window" in text
    assert not any(math.isnan(v) for v in mode.values() if isinstance(v, float))
