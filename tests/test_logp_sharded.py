"""The vocab-sharded linear_logp (gloo, 2 and 4 processes) equals the single-device result bit for bit."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lockstep.kernels as K

V, REAL, H, T = 256, 250, 24, 9


def _inputs():
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, REAL, (T,), generator=g)
    support = torch.randint(-1, REAL, (T, 7), generator=g)
    support[:, 0] = targets
    return hidden, weight, targets, support


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    hidden, weight, targets, support = _inputs()
    shard = V // world
    local = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    kw = dict(vocab_start=rank * shard, full_vocab_size=V, group=dist.group.WORLD, real_vocab_size=REAL)
    full = K.linear_logp(h, local, targets, temperature=0.7, with_entropy=True, **kw)
    full.logp.sum().backward()
    sup = K.linear_logp(hidden, local.detach(), targets, support_ids=support, **kw)
    torch.save({"logp": full.logp.detach(), "entropy": full.entropy.detach(), "support": sup.logp,
                "grad_h": h.grad, "grad_w": local.grad}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_unsharded_bitwise(world, tmp_path):
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    hidden, weight, targets, support = _inputs()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    ref = K.linear_logp(h, w, targets, temperature=0.7, with_entropy=True, real_vocab_size=REAL)
    ref.logp.sum().backward()
    ref_sup = K.linear_logp(hidden, weight, targets, support_ids=support, real_vocab_size=REAL)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]
    for r in ranks:  # every rank ends with the full result
        assert torch.equal(r["logp"], ref.logp.detach())
        assert torch.equal(r["entropy"], ref.entropy.detach())
        assert torch.equal(r["support"], ref_sup.logp)
    # gradients: each rank holds its shard's weight gradient and a partial hidden gradient
    assert torch.allclose(torch.cat([r["grad_w"] for r in ranks]), w.grad, atol=1e-6)
    assert torch.allclose(sum(r["grad_h"] for r in ranks), h.grad, atol=1e-5)


def test_misaligned_shard_is_refused():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match=f"does not hold whole {K.chunk_width(V)}-column chunks"):
        K.linear_logp(hidden, weight[2:100], targets.clamp(max=90), vocab_start=2, full_vocab_size=V)
