"""`cadenza bench serve` against real servers on a tiny random model. Timings are never asserted."""

from __future__ import annotations

import json
import math
import os

import pytest
from server_process import running_server

from cadenza.bench.cli import main
from cadenza.bench.common.workload import make_workload
from cadenza.bench.serving.router_bench import make_multi_turn
from cadenza.bench.serving.serve import arrival_offsets, with_fresh_prompts
from cadenza.bench.serving.serve_clients import RequestRecord
from cadenza.bench.serving.serve_process import check_loopback
from cadenza.bench.serving.stats import Summary, percentile

VOCAB = 320  # tests/tiny_models.py
SHAPE = ["--prompt-len", "4", "16", "--output-len", "2", "8"]
WORKLOAD = dict(prompt_len=(4, 16), output_len=(2, 8), seed=0, vocab_size=VOCAB)


def check_runs(result: dict, num_requests: int, rates: list, protocols=("ws", "http")) -> None:
    """Every request completed with exactly the tokens it asked for; counts and percentiles agree."""
    workload = make_workload(num_requests, **WORKLOAD)
    runs = result["runs"]
    assert [(r["protocol"], r["request_rate"]) for r in runs] == [(p, rate) for p in protocols for rate in rates]
    for run in runs:
        assert run["completed"] == run["num_requests"] == num_requests, run["failures"]
        assert run["failed"] == run["cancelled"] == 0 and run["failures"] == []
        assert run["completed"] + run["failed"] + run["cancelled"] == run["num_requests"]
        assert run["output_tokens"] == workload.num_output_tokens
        assert run["prompt_tokens"] == workload.num_prompt_tokens
        for request, asked in zip(run["requests"], workload.requests):
            assert request["status"] == "completed" and request["finish_reason"] == "length"
            assert request["max_tokens"] == asked.max_tokens == request["output_tokens"]
            assert request["prompt_tokens"] == len(asked.prompt_token_ids)
            if run["protocol"] == "ws":  # the stream's own token ids agree with the usage
                assert request["streamed_tokens"] == asked.max_tokens
            assert request["ttft_ms"] <= request["e2e_ms"]
        for measure in ("ttft_ms", "tpot_ms", "e2e_ms"):
            s = run[measure]
            assert s["p50"] <= s["p90"] <= s["p99"], (measure, s)
        assert run["ttft_ms"]["count"] == num_requests
        assert run["output_tokens_per_s"] > 0 and run["total_tokens_per_s"] > run["output_tokens_per_s"]
        assert run["quiet"]["summary"].startswith(("quiet", "disturbed"))


def test_serve_bench_against_a_running_server(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    with running_server(tiny_model_dir("llama3")) as server:
        code = main(["serve", "--url", server.url, "--vocab-size", str(VOCAB), "--num-requests", "6", *SHAPE,
                     "--request-rates", "20", "inf", "--no-quiet-check", "--json", str(out)])
        printed = capsys.readouterr().out
        assert code == 0, printed
        assert server.proc.poll() is None  # the bench leaves a server it did not start running
    result = json.loads(out.read_text())
    check_runs(result, 6, [20.0, "inf"])
    assert result["server"]["launched"] is False
    assert result["server"]["pid"] == server.proc.pid  # found from its listening socket
    assert result["offline"] is None and "give --model" in result["offline_note"]
    assert result["command"].startswith("cadenza bench serve --url ")
    for column in ("protocol", "rate", "completed", "cancelled", "output tok/s", "TTFT ms p50", "TPOT ms p99", "E2E ms p90"):
        assert column in printed
    assert "workload: 6 requests" in printed


def test_serve_bench_launches_and_stops_its_server(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["serve", "--model", str(tiny_model_dir("llama3")), "--dtype", "float32", "--num-requests", "4", *SHAPE,
                 "--request-rates", "inf", "--no-quiet-check", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    check_runs(result, 4, ["inf"])
    pid = result["server"]["pid"]
    assert result["server"]["launched"] is True and pid != os.getpid()
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(pid, 0)
    # The same workload offline, and serving over offline per protocol.
    offline = result["offline"]
    assert offline["output_tokens"] == make_workload(4, **WORKLOAD).num_output_tokens and not offline["note"]
    assert {o["protocol"] for o in result["overhead"]} == {"ws", "http"}
    for row in result["overhead"]:
        assert row["serving_over_offline"] > 0 and row["overhead_percent"] is not None, row
    assert "overhead" in printed and "offline output tok/s" in printed


def test_max_concurrency_keeps_that_many_in_flight():
    """`run_load(concurrency=N)` at rate inf: N streams back to back, never more in flight, every
    request sent (guidellm's concurrent profile)."""
    import time

    import anyio

    from cadenza.bench.serving.serve import run_load

    class CountingClient:
        protocol = "fake"

        def __init__(self) -> None:
            self.in_flight = self.most = self.sent = 0

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info) -> None:
            return None

        def start(self, tg) -> None:
            pass

        async def warmup(self) -> None:
            pass

        async def send(self, index, request, record: RequestRecord) -> None:
            self.in_flight += 1
            self.most, self.sent = max(self.most, self.in_flight), self.sent + 1
            record.sent_at = time.perf_counter()
            await anyio.sleep(0.01 * (1 + index % 3))  # uneven lengths: slots free up out of order
            record.on_tokens(time.perf_counter(), request.max_tokens)
            record.complete(time.perf_counter(), "length", request.max_tokens, streamed=False)
            self.in_flight -= 1

    workload = make_workload(9, **WORKLOAD)
    for cap, most in ((3, 3), (None, 9)):
        client = CountingClient()
        records, seconds = anyio.run(run_load, client, workload, [0.0] * 9, 30.0, cap)
        assert client.sent == 9 and client.most == most and seconds > 0
        assert [r.status for r in records] == ["completed"] * 9


def test_serve_bench_at_a_concurrency(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    with running_server(tiny_model_dir("llama3")) as server:
        code = main(["serve", "--url", server.url, "--vocab-size", str(VOCAB), "--num-requests", "5", *SHAPE,
                     "--protocols", "http", "--request-rates", "inf", "--max-concurrency", "2", "--no-quiet-check",
                     "--json", str(out)])
        printed = capsys.readouterr().out
        assert code == 0, printed
    result = json.loads(out.read_text())
    check_runs(result, 5, ["inf"], protocols=("http",))
    assert result["runs"][0]["max_concurrency"] == 2 and result["plan"]["max_concurrency"] == [2]
    assert "inf, 2 streams" in printed


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "http://example.com:8000", "ws://127.0.0.1:8000", "127.0.0.1:8000"])
def test_a_non_loopback_url_is_refused(url, capsys):
    assert main(["serve", "--url", url, "--no-quiet-check"]) == 2
    err = capsys.readouterr().err
    assert "--url" in err and ("loopback" in err or "look like" in err)


# --- pieces -------------------------------------------------------------------------------------


def test_loopback_addresses_are_accepted():
    for url in ("http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:8000", "http://127.1.2.3:9"):
        assert not check_loopback(url).endswith("/")


def test_arrivals_are_seeded_poisson_or_all_at_once():
    assert arrival_offsets(5, math.inf, seed=1) == [0.0] * 5
    a, b = arrival_offsets(200, 4.0, seed=1), arrival_offsets(200, 4.0, seed=1)
    assert a == b != arrival_offsets(200, 4.0, seed=2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    assert 30 < a[-1] < 70  # 199 exponential gaps of mean 1/4 s: about 50 s
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=1)


def test_each_run_gets_fresh_prompts_of_the_same_shape():
    # The server's prefix cache must not serve one run's prompts from another's.
    base = make_workload(6, **WORKLOAD)
    a, b = with_fresh_prompts(base, "ws-inf-0", VOCAB), with_fresh_prompts(base, "http-inf-0", VOCAB)
    assert a == with_fresh_prompts(base, "ws-inf-0", VOCAB)
    for x, y, z in zip(base.requests, a.requests, b.requests):
        assert len(x.prompt_token_ids) == len(y.prompt_token_ids) == len(z.prompt_token_ids)
        assert x.max_tokens == y.max_tokens == z.max_tokens
        assert x.prompt_token_ids != y.prompt_token_ids != z.prompt_token_ids
        assert all(0 <= t < VOCAB for t in y.prompt_token_ids)


def test_percentiles_interpolate_and_stay_ordered():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([5.0], 99) == 5.0
    s = Summary.of([float(v) for v in range(1, 101)])
    assert s.p50 == pytest.approx(50.5) and s.p50 <= s.p90 <= s.p99 <= 100
    assert Summary.of([]) is None


def test_a_request_is_complete_only_with_its_exact_token_count():
    def record(streamed: int) -> RequestRecord:
        r = RequestRecord(0, num_prompt_tokens=4, max_tokens=5, sent_at=1.0)
        r.on_tokens(1.5, streamed)
        return r

    ok = record(5)
    ok.complete(3.5, "length", 5, streamed=True)
    assert ok.status == "completed" and ok.ttft == 0.5 and ok.tpot == pytest.approx(0.5) and ok.e2e == 2.5
    cases = [(record(5), "length", 4, True, "usage says 4"), (record(3), "length", 5, True, "streamed 3"),
             (record(5), "stop", 5, True, "finish_reason 'stop'"), (record(0), "length", None, False, "no usage")]
    for r, finish, usage, streamed, reason in cases:
        r.complete(3.0, finish, usage, streamed)
        assert r.status == "failed" and reason in r.error and r.tpot is None


# --- --workload kv-tiers ------------------------------------------------------------------------


def test_kv_tiers_bench_runs_both_arms_and_a_restart(tiny_model_dir, tmp_path, capsys):
    """Both arms on servers of their own with the same KV budget, the disk arm's tier in use, and a
    restart over the disk tier against a cold server: every request completes, the report has its fields."""
    out = tmp_path / "tiers.json"
    sizes = ["--conversations", "3", "--system-prompts", "1", "--system-len", "48", "--turns", "2", "--user-len", "8", "12",
             "--output-len", "4", "4", "--kv-blocks", "16"]
    code = main(["serve", "--workload", "kv-tiers", "--model", str(tiny_model_dir("llama3")), "--dtype", "float32",
                 "--vocab-size", str(VOCAB), *sizes, "--request-rates", "50", "--max-duration", "60", "--restart",
                 "--restart-requests", "2", "--no-quiet-check", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(out.read_text())
    assert [r["arm"] for r in result["runs"]] == ["budget", "disk"]
    workload = make_multi_turn(3, 1, 2, 48, (8, 12), (4, 4), seed=0, salt="0", vocab_size=VOCAB)
    assert result["budget_tokens"] == 16 * 16  # 16 blocks of 16 tokens, read back from /metrics
    assert result["working_set_tokens"] == 48 + sum(len(m) + 4 for turns in workload.user_messages for m in turns)
    pids = set()
    for run in result["runs"]:
        assert run["completed"] == run["num_requests"] == 6 and run["failed"] == run["cancelled"] == 0, run["failures"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s"):
            assert run[key] > 0, key
        assert run["ttft_p50_ms"] <= run["ttft_p99_ms"] and 0 <= run["prefix_hit_rate"] <= 1
        metrics = run["metrics"]
        assert metrics["budget_tokens"] == 256 and metrics["prefix_queried_tokens"] >= run["prompt_tokens"]
        assert 0 <= metrics["prefix_hit_rate"] <= 1
        pids.add(run["server_pid"])
    budget, disk = (r["metrics"] for r in result["runs"])
    assert budget["disk_written_mb"] == budget["disk_hit_blocks"] == 0 and disk["disk_written_mb"] > 0
    assert set(result["ratios"]) == {"ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s", "prefix_hit_rate"}
    assert set(result["targets"]) == {"output_tokens_per_s", "ttft_p99_ms"}
    restart = result["restart"]
    assert len(restart["ttft_after_restart_ms"]) == len(restart["ttft_cold_ms"]) == 2 and not restart["failed"]
    assert all(t > 0 for t in restart["ttft_after_restart_ms"] + restart["ttft_cold_ms"])
    # The restarted server found the first half's blocks on disk: the prompts' leading blocks came back.
    assert restart["metrics_after_restart"]["disk_hit_blocks"] > 0 and min(restart["cached_tokens_after_restart"]) > 0
    assert len(pids) == 2 and os.getpid() not in pids
    for pid in pids:  # each arm's server stopped and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for column in ("arm", "TTFT p99 ms", "output tok/s", "hit rate /metrics", "disk hits", "disk / budget", "targets",
                   "restart:", "working set"):
        assert column in printed
