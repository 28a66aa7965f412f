"""`model.thread_binding` (threads/binding.py, docs/cpu-threads.md): which CPU each thread of the
compute thread's team is pinned to, decided from the setting, the team and the process's CPUs, and
the pinning itself seen from /proc in a child process (pinning is per thread and lasts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError

from cadenza.config import ConfigError, ModelConfig, environment
from cadenza.config.schema import parse_cpu_list
from cadenza.threads.binding import one_cpu_per_core, plan_binding


def test_cpu_lists_read_as_linux_writes_them():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("2,0,2") == [2, 0]  # the order written, each once
    assert parse_cpu_list("0-1023")[-1] == 1023  # a whole mask, at once
    for bad in ("", "a", "3-1", "1-", "-1", "0,,1", "0-999999"):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_the_setting_is_checked_when_the_config_is_read():
    assert ModelConfig(thread_binding="0-1").thread_binding == "0-1"
    assert ModelConfig().thread_binding == "auto"
    with pytest.raises(ValidationError, match="thread_binding"):
        ModelConfig(thread_binding="3-1")


def _topology(root, siblings: dict[int, str]):
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(f"{listed}\n")
    return root


def test_one_cpu_per_physical_core(tmp_path):
    smt = _topology(tmp_path / "smt", {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})  # 2 cores, 2 threads each
    assert one_cpu_per_core([0, 1, 2, 3], smt) == [0, 1]
    assert one_cpu_per_core([2, 3], smt) == [2, 3]
    no_smt = _topology(tmp_path / "plain", {0: "0", 1: "1"})
    assert one_cpu_per_core([0, 1], no_smt) == [0, 1]
    assert one_cpu_per_core([0, 1], tmp_path / "none") == [0, 1]  # no topology: every CPU


@pytest.mark.parametrize(
    ("setting", "threads", "allowed", "cores", "environ", "expected"),
    [
        ("auto", 2, [0, 1], [0, 1], {}, [0, 1]),
        ("auto", 2, [0, 1, 2, 3], [0, 1], {}, [0, 1]),  # SMT: one thread a physical core
        ("auto", 4, [0, 1, 2, 3], [0, 1], {}, [0, 1, 2, 3]),  # a thread every logical CPU
        ("auto", 1, [0, 1], [0, 1], {}, None),  # one thread leaves a core to others: the OS places it
        ("auto", 3, [0, 1, 2, 3], [0, 1, 2, 3], {}, None),  # a team that does not cover the cores
        ("auto", 2, [0, 1], [0, 1], {environment.OMP_PROC_BIND.name: "false"}, None),  # the user's OpenMP binding
        ("auto", 2, [0, 1], [0, 1], {environment.GOMP_CPU_AFFINITY.name: "0"}, None),
        ("none", 2, [0, 1], [0, 1], {}, None),
        ("1,0", 2, [0, 1], [0, 1], {}, [1, 0]),
        ("0-3", 2, [0, 1, 2, 3], [0, 1, 2, 3], {}, [0, 1]),  # a longer list: the team's first
    ],
    ids=["auto", "auto-smt-cores", "auto-smt-every-cpu", "auto-one-thread", "auto-partial-team", "omp-proc-bind",
         "gomp-cpu-affinity", "none", "list", "longer-list"],
)  # fmt: skip
def test_plan(setting, threads, allowed, cores, environ, expected):
    cpus, why = plan_binding(setting, threads, allowed, cores, environ)
    assert cpus == expected
    assert why


def test_an_adaptive_team_is_left_to_the_os_and_a_list_refused():
    assert plan_binding("auto", 2, [0, 1], [0, 1], {}, adaptive=True)[0] is None
    with pytest.raises(ConfigError, match="thread_policy adaptive resizes it"):
        plan_binding("0,1", 2, [0, 1], [0, 1], {}, adaptive=True)


def test_data_parallel_replicas_never_pin_by_themselves():
    from cadenza.cluster.replicas import _one_replica
    from cadenza.config import CadenzaConfig
    from cadenza.parallel.placement import ReplicaShape

    shape = ReplicaShape(replicas=2, ranks=1, threads=1, gpus=False)
    assert _one_replica(CadenzaConfig(), shape).model.thread_binding == "none"  # each would pin the same cores
    listed = CadenzaConfig(model={"thread_binding": "1"})
    assert _one_replica(listed, shape).model.thread_binding == "1"  # the user's list stands


def test_a_list_that_cannot_hold_the_team_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.thread_binding: 1 CPUs for a team of 2"):
        plan_binding("0", 2, [0, 1], [0, 1], {})
    with pytest.raises(ConfigError, match=r"model.thread_binding: CPUs \[5\] are not ones this process may run on"):
        plan_binding("0,5", 2, [0, 1], [0, 1], {})


# The default model, two tokens, then each thread's CPU mask from /proc (pinned threads have one CPU).
_ENGINE_THREADS = """
    import json, os
    from cadenza import LLM, SamplingParams

    def masks():  # each live thread's CPU list (a thread may end while this reads)
        found = []
        for tid in os.listdir("/proc/self/task"):
            try:
                lines = open(f"/proc/self/task/{tid}/status").read().splitlines()
            except OSError:
                continue
            found += [line.split()[-1] for line in lines if line.startswith("Cpus_allowed_list")]
        return found

    llm = LLM(**{"logging.level": "warning", **%s})
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    during = masks()
    llm.close()
    print(json.dumps({"masks": during, "after": masks()}))  # after: once the engine has stopped
"""


def _engine_masks(overrides: dict, when: str = "masks") -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k not in {v.name for v in environment.ALL if v.name.startswith(("OMP_", "GOMP_", "KMP_"))}}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_ENGINE_THREADS % json.dumps(overrides))], env=environ,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])[when]


def _pinned(masks: list[str]) -> list[str]:
    return sorted(m for m in masks if "-" not in m and "," not in m)


needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2 or not os.path.exists("/proc/self/task"),
    reason="the engine's default team covers the CPUs exactly on a 2-CPU Linux process",
)


@needs_two_cpus
def test_an_engine_pins_its_team_one_thread_a_cpu_and_gives_them_back_when_it_stops():
    allowed = sorted(os.sched_getaffinity(0))
    assert _pinned(_engine_masks({})) == [str(cpu) for cpu in allowed]
    assert _pinned(_engine_masks({}, when="after")) == []


@needs_two_cpus
def test_none_leaves_every_thread_to_the_os_and_a_list_pins_where_it_says():
    assert _pinned(_engine_masks({"model.thread_binding": "none"})) == []
    last = str(max(os.sched_getaffinity(0)))
    assert _pinned(_engine_masks({"model.num_threads": 1, "model.thread_binding": last})) == [last]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux's CPU masks")
def test_a_list_the_process_cannot_use_fails_the_build_by_name():
    from cadenza import LLM

    outside = str(max(os.sched_getaffinity(0)) + 1)
    with pytest.raises(ConfigError, match=rf"model.thread_binding: CPUs \[{outside}\] are not ones this process may run on"):
        LLM(**{"logging.level": "warning", "model.num_threads": 1, "model.thread_binding": outside})
