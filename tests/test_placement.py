"""The placement plan (`--ray.placement`) on fake Ray nodes: every layout, the thread shares, and the
errors that say what is short; then two simulated Ray nodes on this machine, where the loop runs with
the engine on one node and the trainer on the other, and the engine, killed, serves again on its node only
with the policy's weights."""

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from helpers.loop import ROOT, kill_when, logged, make_cfg, rows

from instar.contract import read_jsonl
from instar.loop import run
from instar.runtime.placement import Node, PlacementError, Slot, plan


def gpu_nodes(*gpus: int) -> list[Node]:
    return [Node(f"n{i}", 16, g) for i, g in enumerate(gpus)]


def test_one_cpu_node_shares_its_cores_between_everything_that_computes_at_once():
    [node] = cpu = [Node("head", 2, 0)]
    assert plan(cpu, 1, 0, 1) == plan(cpu, 1, 0, 1, "disaggregated")  # one node: nothing to split
    assert plan(cpu, 1, 0, 1).engines == [Slot("head", 0, 2)] and plan(cpu, 1, 0, 1).ranks == [Slot("head", 0, 2)]
    synced = plan(cpu, 2, 0, 1, sync=True)  # generation and training take turns: each side has every core
    assert synced.engines == [Slot("head", 0, 2)] * 2 and synced.ranks == [Slot("head", 0, 1)]
    assert plan(cpu, 0, 0, 2).ranks == [Slot("head", 0, 2)] * 2  # the trainer alone (SFT, replay)
    assert plan(cpu, 2, 0, 0).engines == [Slot("head", 0, 2)] * 2  # engines alone (instar eval)


def test_cpu_nodes_disaggregate_the_trainer_on_the_drivers_node_and_engines_on_the_others():
    cpu = [Node("head", 8, 0), Node("a", 8, 0), Node("b", 8, 0)]
    where = plan(cpu, 3, 0, 2)
    assert where.layout == "disaggregated"
    assert where.ranks == [Slot("head", 0, 2)] * 2
    assert where.engines == [Slot("a", 0, 2), Slot("b", 0, 1), Slot("a", 0, 2)]  # round robin, shares per node
    assert plan(cpu, 3, 0, 2, "colocated").layout == "colocated"
    assert {s.node_id for s in plan(cpu, 3, 0, 2, "colocated").engines} == {"head"}


def test_gpus_disaggregated_when_enough_each_engine_on_one_node_trainer_first():
    where = plan(gpu_nodes(8), 2, 2, 4)
    assert where.layout == "disaggregated"
    assert where.ranks == [Slot("n0", 1, 1)] * 4
    assert where.engines == [Slot("n0", 0, 1)] * 2  # tp 2: vLLM's workers take the GPUs, not the actor
    where = plan(gpu_nodes(4, 4), 2, 2, 4)
    assert [s.node_id for s in where.ranks] == ["n0"] * 4 and [s.node_id for s in where.engines] == ["n1"] * 2
    assert plan(gpu_nodes(2), 1, 1, 1).engines == [Slot("n0", 1, 1)]  # tp 1: the engine actor holds its GPU
    assert plan(gpu_nodes(1), 1, 0, 1).engines == [Slot("n0", 0, 1)]  # an engine on CPUs takes no GPU
    assert [plan(gpu_nodes(2), 1, 1, 1).transport, plan(gpu_nodes(1), 1, 0, 1).transport] == ["nccl", "gloo"]
    assert plan([Node("head", 2, 0)], 1, 0, 1).transport == "gloo"


def test_one_gpu_is_shared_colocated_and_short_clusters_say_what_is_missing():
    where = plan(gpu_nodes(1), 1, 1, 1)  # auto: 2 GPUs needed apart, 1 found: share it
    assert where.layout == "colocated" and where.engines == [Slot("n0", 0.5, 1)] and where.ranks == [Slot("n0", 0.5, 1)]
    assert where.transport == "ipc"  # NCCL refuses two ranks on one GPU
    where = plan(gpu_nodes(2, 2), 4, 1, 4, "colocated")
    assert [s.node_id for s in where.engines] == [s.node_id for s in where.ranks] == ["n0", "n0", "n1", "n1"]
    assert where.transport == "gloo"  # IPC reaches rank 0's GPU alone: the others through host memory
    with pytest.raises(PlacementError, match=r"^2 engines x tp 2 \+ 4 trainer ranks need 8 GPUs, found 4 "):
        plan(gpu_nodes(4), 2, 2, 4, "disaggregated")
    with pytest.raises(PlacementError, match="engine 1 needs 2 GPUs on one node .* have \\[1, 1\\] left after 2"):
        plan(gpu_nodes(3, 3), 2, 2, 2, "disaggregated")
    with pytest.raises(PlacementError, match="needs --engine.tensor_parallel_size 1, got 2"):
        plan(gpu_nodes(2), 2, 2, 2)
    with pytest.raises(PlacementError, match="^4 engines x tp 1 \\+ 2 trainer ranks need 4 GPUs colocated, found 2"):
        plan(gpu_nodes(2), 4, 1, 2)


# -- two simulated Ray nodes, and a `ray start` cluster ------------------------------------------------

ENV = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}


@pytest.fixture
def two_nodes():
    """A Ray head and one worker node on this machine (Ray's multi-node test cluster); always shut down."""
    from ray.cluster_utils import Cluster as RayCluster

    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, runtime_env=ENV)
        yield cluster.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def homes(monkeypatch):
    """The node of each engine and trainer rank of the run's Cluster, asked just before it stops them."""
    from instar.runtime.cluster import Cluster

    found, leave = {}, Cluster.__aexit__

    async def record(self, *exc):
        def node(_actor) -> str:
            return ray.get_runtime_context().get_node_id()

        for name, actors in (("engines", self.engines), ("ranks", self.trainer.ranks)):
            found[name] = [await a.__ray_call__.remote(node) for a in actors]
        await leave(self, *exc)

    monkeypatch.setattr(Cluster, "__aexit__", record)
    return found


@pytest.mark.slow
def test_the_loop_runs_with_the_engine_on_one_node_and_the_trainer_on_the_other(two_nodes, tmp_path, tiny_model_dir,
                                                                                 prompts, clusters, homes, capsys):
    head, worker = two_nodes
    cfg = make_cfg(tmp_path, tiny_model_dir, prompts, **{
        "train.force_sync_mode": True, "train.agent_path": str(ROOT / "tests/agents/slow_env.py"),
        "train.rollout_dump_dir": str(tmp_path / "dump")})  # step 2's sync comes >= 1.5 s after the kill
    killed = kill_when(logged(tmp_path / "run/metrics.jsonl", 1), lambda: clusters[0].engines[0])
    run(cfg)  # the lone engine, killed after step 1, is restarted on its own node and given the weights again
    out = capsys.readouterr().out
    assert f"placement disaggregated (--ray.placement auto): engines on nodes ['{worker[:8]}'], " \
           f"trainer ranks on ['{head[:8]}']" in out
    metrics = rows(tmp_path / "run/metrics.jsonl")
    assert killed and [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["faults/engine_restarts"] for m in metrics] == [0, 1, 1]  # found and rejoined at step 2's sync
    # step 3 was sampled after that sync: nothing dropped, every token from policy version 2
    third = read_jsonl(str(tmp_path / "dump/step_000003.jsonl"))
    versions = {v for t in third for s in t.segments for v, m in zip(s.versions, s.action_mask) if m}
    assert len(third) == 8 and versions == {2}
    assert all(m["weight_sync/bytes"] > 0 for m in metrics) and abs(metrics[-1]["actor/vllm_kl"]) < 1e-3, metrics
    assert homes == {"engines": [worker], "ranks": [head]}  # where the actors ran, the restarted engine too


@pytest.mark.slow
def test_instar_rl_runs_against_a_ray_start_cluster(tmp_path, tiny_model_dir, prompts):
    ray_bin = Path(sys.executable).parent / "ray"
    # a cluster with token authentication, as `ray start` runs once a token exists; instar is given the token
    env = {**os.environ, "RAY_ADDRESS": "", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for _ in range(3):  # the port is free when found, and may be taken before `ray start` binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        started = subprocess.run([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2",
                                  "--include-dashboard=false", "--disable-usage-stats"],
                                 capture_output=True, text=True, env=env, timeout=120)
        if started.returncode == 0:
            break
        subprocess.run([str(ray_bin), "stop", "--force"], capture_output=True, env=env, timeout=120)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        done = subprocess.run(
            [str(Path(sys.executable).parent / "instar"), "rl", "--ray.address", f"127.0.0.1:{port}",
             "--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", prompts,
             "--train.agent_path", str(ROOT / "tests/agents/length_env.py"), "--train.max_steps", "1",
             "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--data.max_new_tokens", "8",
             "--ckpt.output_dir", str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "Started a local Ray instance" not in done.stderr and "Connected to Ray cluster" in done.stderr
        assert [m["step"] for m in rows(tmp_path / "run/metrics.jsonl")] == [1]
    finally:
        subprocess.run([str(ray_bin), "stop", "--force"], capture_output=True, env=env, timeout=120)


def test_the_slurm_script_passes_shellcheck_and_runs_instar_on_the_ray_head():
    script = ROOT / "scripts/slurm.sbatch"
    check = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), str(script)], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout
    lines = script.read_text().splitlines()
    [head_start] = [line for line in lines if "ray start --head" in line]
    [driver] = [line for line in lines if "instar rl" in line and not line.startswith("#")]
    assert '-w "$head"' in head_start and '-w "$head"' in driver  # the driver's node: the trainer's (plan())
