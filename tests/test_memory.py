"""Loading at real size: a model built on the meta device, sharded, then filled from the checkpoint
with each rank reading only its slices equals `load_model` bit for bit (dense and MoE, causal LM and
critic trunk, 1 and 2 FSDP ranks, FSDP over tensor parallelism and HSDP on 2-D meshes), and a rank
reads 1/world of the checkpoint."""

import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from instar.train.attention import attention_for
from instar.train.launch import reserve_port, run_ranks
from instar.train.load import ReadStats, Source, local_index, materialize, meta_model
from instar.train.model import ValueModel, decoder_layers, load_model
from instar.train.parallel import init_distributed

IDS = torch.tensor([[5, 77, 301, 9, 42, 260, 17, 3, 99, 400, 12, 8]])
POS = torch.arange(12)[None]


def _build(path: str, critic: bool, dtype: str = "float32") -> torch.nn.Module:
    return ValueModel(meta_model(path, dtype, causal_lm=False)) if critic else meta_model(path, dtype)


def _reference(path: str, critic: bool, dtype: str = "float32") -> torch.nn.Module:
    """The model as transformers' from_pretrained loads it whole (the critic: its trunk plus a value head)."""
    if not critic:
        return load_model(path, dtype)
    from transformers import AutoModel
    trunk = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation=attention_for(path))
    trunk.config.use_cache = False
    return ValueModel(trunk).train()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compare(model: torch.nn.Module, path: str, critic: bool, dtype: str = "float32") -> dict:
    """What differs from the normally loaded model (nothing, when loading is right) and both outputs."""
    ref = _reference(path, critic, dtype)
    ours = {n: _full(t) for n, t in model.state_dict().items()}
    theirs = ref.state_dict()
    differ = sorted(n for n in theirs if n not in ours or ours[n].dtype != theirs[n].dtype
                    or not torch.equal(ours[n], theirs[n]))
    bufs = dict(model.named_buffers())
    differ += sorted(n for n, b in ref.named_buffers() if not torch.equal(_full(bufs[n]), b))
    with torch.no_grad():
        out = [m(IDS, POS) if critic else m(input_ids=IDS, position_ids=POS).logits for m in (model, ref)]
    return {"differ": differ, "keys": sorted(ours) == sorted(theirs), "out": out}


def _checkpoint_bytes(path: str) -> int:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


@pytest.mark.parametrize("moe", [False, True])
def test_materialized_meta_model_equals_load_model(tiny_model_dir, tiny_moe_dir, moe):
    path = str(tiny_moe_dir if moe else tiny_model_dir)
    for critic, dtype in [(False, "float32"), (False, "bfloat16"), (True, "float32")]:
        model = _build(path, critic, dtype)
        assert all(p.is_meta for n, p in model.named_parameters() if n != "value_head.weight")
        stats = materialize(model, path)
        got = _compare(model, path, critic, dtype)  # dtypes too: the float32 checkpoint cast as from_pretrained does
        assert got["keys"] and got["differ"] == []
        assert torch.equal(*got["out"])
        assert stats.bytes == _checkpoint_bytes(path)  # unsharded: every tensor once, tied ones too
    assert model.trunk.training and not model.trunk.config.use_cache
    if not moe:  # the checkpoint's sampling defaults survive into an HF export
        assert meta_model(path).generation_config.do_sample is False


def _fsdp_job(rank, world, port, paths):
    init_distributed(rank, world, "127.0.0.1", port)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for path, critic in [(paths[0], False), (paths[1], False), (paths[0], True)]:
        model = _build(path, critic)
        for layer in decoder_layers(model):  # what instar.train.parallel.apply_fsdp does
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        stats = materialize(model, path)
        got = _compare(model, path, critic)
        tied = critic or model.lm_head.weight is model.model.embed_tokens.weight
        out[(path, critic)] = {**got, "bytes": stats.bytes, "tied": tied}
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_load_equals_load_model(tiny_model_dir, tiny_moe_dir, world):
    paths = (str(tiny_model_dir), str(tiny_moe_dir))
    # one rank runs in this process (saves a process start); the job destroys its process group
    if world == 1:
        results = [_fsdp_job(0, 1, reserve_port(), paths)]
    else:
        results = run_ranks(_fsdp_job, world, paths, timeout=300)
    for (path, critic), got in results[0].items():
        assert got["keys"] and got["differ"] == [], (path, critic)
        assert torch.equal(*got["out"]) and got["tied"]
        # FSDP shards every tensor on dim 0 (all even here): each rank reads exactly its half
        per_rank = [r[(path, critic)]["bytes"] for r in results]
        assert per_rank == [_checkpoint_bytes(path) // world] * world, per_rank


PLACEMENTS = [  # (mesh shape, tensor shape, placements): uneven splits, empty shards, strided FSDP-over-TP
    ((2, 2), (7, 5), (Shard(0), Shard(1))),
    ((2, 2), (7, 5), (Shard(1), Shard(0))),
    ((2, 2), (7, 5), (Shard(0), Shard(0))),
    ((2, 2), (7, 5), (Replicate(), Shard(1))),
    ((2, 2), (8, 6), (_StridedShard(0, split_factor=2), Shard(0))),
    ((4,), (3, 5), (Shard(0),)),
]


def _layout_job(rank, world, port, path, table_file):
    init_distributed(rank, world, "127.0.0.1", port)
    checks = []
    for k, (mesh_shape, shape, placements) in enumerate(PLACEMENTS):
        full = torch.arange(float(torch.Size(shape).numel())).view(shape)
        truth = distribute_tensor(full, init_device_mesh("cpu", mesh_shape), placements)  # scatters from rank 0
        local, index = local_index(truth)
        read = Source({f"t{k}": table_file}, [[f"t{k}"]]).read(index, ReadStats())
        checks.append(torch.equal(read, local))
    # a real model on a (dp, tp) mesh: tensor parallel attention and MLP, FSDP over dp on top
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = meta_model(path, attn="sdpa")
    plan = {**{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")}, "mlp.down_proj": RowwiseParallel()}
    for layer in decoder_layers(model):
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {str(p.placements) for p in model.parameters()}
    materialize(model, path)
    ref = load_model(path)
    differ = [n for n, t in model.state_dict().items() if not torch.equal(t.full_tensor(), ref.state_dict()[n])]
    hsdp = meta_model(path)  # HSDP: replicated over the first mesh dim, sharded over the second
    fully_shard(hsdp, mesh=mesh)
    stats = materialize(hsdp, path)
    differ += [n for n, t in hsdp.state_dict().items() if not torch.equal(t.full_tensor(), ref.state_dict()[n])]
    dist.destroy_process_group()
    return {"checks": checks, "differ": differ, "placements": placements, "hsdp_bytes": stats.bytes}


def test_each_rank_reads_its_slice_on_2d_meshes(tiny_model_dir, tmp_path):
    table = {f"t{k}": torch.arange(float(torch.Size(shape).numel())).view(shape)
             for k, (_, shape, _) in enumerate(PLACEMENTS)}
    save_file(table, tmp_path / "table.safetensors")
    results = run_ranks(_layout_job, 4, str(tiny_model_dir), str(tmp_path / "table.safetensors"), timeout=300)
    for rank, got in enumerate(results):
        assert got["checks"] == [True] * len(PLACEMENTS), rank
        assert got["differ"] == [], rank
        assert got["hsdp_bytes"] == _checkpoint_bytes(str(tiny_model_dir)) // 2
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in results[0]["placements"]  # the colwise weights


def test_source_reads_boxes_of_fused_experts_and_strided_positions(tmp_path):
    # fused experts as transformers builds gate_up_proj: stack each list over experts, concatenate on dim 1
    parts = {f"e{e}.{w}": torch.arange(6.0).view(3, 2) + 100 * e + 10 * (w == "up") for e in range(3)
             for w in ("gate", "up")}
    save_file(parts, tmp_path / "experts.safetensors")
    files = dict.fromkeys(parts, str(tmp_path / "experts.safetensors"))
    gates, ups = [[f"e{e}.{w}" for e in range(3)] for w in ("gate", "up")]
    fused = torch.cat([torch.stack([parts[k] for k in gates]), torch.stack([parts[k] for k in ups])], dim=1)
    stats = ReadStats()
    box = (slice(1, 3), slice(2, 5), slice(0, 2))  # experts 1-2, rows across the gate/up boundary
    got = Source(files, [gates, ups], stacked=True, cat_dim=1).read(box, stats)
    assert torch.equal(got, fused[box])
    assert stats.bytes == 2 * 3 * 2 * 4  # exactly the box
    full = torch.arange(40.0).view(8, 5)
    save_file({"w": full}, tmp_path / "w.safetensors")
    rows, stats = torch.tensor([1, 3, 6]), ReadStats()
    got = Source({"w": str(tmp_path / "w.safetensors")}, [["w"]]).read((rows, slice(2, 4)), stats)
    assert torch.equal(got, full[rows, 2:4])
    assert stats.bytes == 6 * 2 * 4  # the bounding box, rows 1..6 of columns 2..3


def test_loading_errors_name_the_fix(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="not a local checkpoint directory"):
        meta_model(str(tmp_path / "nowhere"))
    with torch.device("meta"):
        critic = ValueModel(meta_model(str(tiny_model_dir), causal_lm=False))
    with pytest.raises(ValueError, match=r"\['value_head.weight'\] are on the meta device but not part of the HF"):
        materialize(critic, str(tiny_model_dir))
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    with safe_open(str(broken / "model.safetensors"), framework="pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if k != "model.norm.weight"}
    save_file(kept, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight is not in the checkpoint"):
        materialize(meta_model(str(broken)), str(broken))
