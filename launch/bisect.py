"""`lockstep bisect RUN_DIR --step N [--sample S] [--all]`: where trainer and rollout part.

A run records its first mismatching step (determinism.record_mismatch: the rollout, the trainer's
logprobs and the weights, consistency/record.py). Bisect replays one sample of it on both sides,
each with the ops its side of the run selected (determinism.case, the module toggles, stock_ops,
inject_fault) on the native Qwen3 model, the one layer definition every backend adapts
(models/layer.py): the trainer side teacher-forces the whole sequence, as every actor scores; the
rollout side prefills the prompt and decodes the recorded response one token at a time against its
KV cache, as the native engine generates. Every op's output is hashed per token row (the tap of
models/ops.py's counter); the first op, in execution order, whose rows differ between the sides is
printed with its layer, and then the reported logprob. The replay also says whether each side
reproduces the logprobs the run recorded: when it does not (a vLLM engine, a megatron actor on
another device), the difference the run saw lies in that backend's own code, outside the shared math.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

# one decoder layer's op calls in execution order (models/layer.py): (slot, what it computes)
# (the native model holds q/k/v and gate/up apart: an adapter with fused weights calls linear_rows)
LAYER_OPS = (("attention.rms_norm", "input_layernorm"), ("attention.linear", "q_proj"), ("attention.linear", "k_proj"),
             ("attention.linear", "v_proj"), ("attention.rms_norm", "q_norm"), ("attention.rms_norm", "k_norm"),
             ("attention.apply_rope", "rope(q)"), ("attention.apply_rope", "rope(k)"),
             ("attention.attention", "attention core"), ("attention.row_linear", "o_proj"),
             ("ffn.rms_norm", "post_attention_layernorm"), ("ffn.linear", "gate_proj"), ("ffn.linear", "up_proj"),
             ("ffn.silu_mul", "silu_mul"), ("ffn.row_linear", "down_proj"))
IGNORED = ("logp.linear", "logp.linear_logp")  # sampling logits (rollout only); the logprob is compared apart
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def row_hashes(t: torch.Tensor) -> torch.Tensor:
    """[B, T] int64: one hash of each token row's bit pattern (t [B, T, n])."""
    bits = t.contiguous().view(_INT_VIEW[t.element_size()]).to(torch.int64)
    # a multiplier per column: changing any one element changes the (wrapping) sum
    weights = torch.arange(1, bits.shape[-1] + 1, dtype=torch.int64, device=bits.device) * 2654435761
    return (bits * weights).sum(-1).cpu()


def _rows(out) -> torch.Tensor:
    """An op's output [B, T, ...] (a tuple: concatenated per token row) as [B, T, n]."""
    parts = out if isinstance(out, tuple) else (out,)
    return torch.cat([p.reshape(*p.shape[:2], -1) for p in parts], -1)


class Tracer:
    """Per-row hashes of every op of every forward (a forward starts at rope_cos_sin)."""

    def __init__(self, num_layers: int):
        self.expected = ["attention.rope_cos_sin", *[k for _ in range(num_layers) for k, _ in LAYER_OPS], "logp.rms_norm"]
        self.forwards: list[list[tuple[str, torch.Tensor]]] = []

    def tap(self, key: str, out) -> None:
        if key in IGNORED:
            return
        if key == "attention.rope_cos_sin":
            self.forwards.append([])
        self.forwards[-1].append((key, row_hashes(_rows(out))))

    def per_op(self) -> list[list[torch.Tensor]]:
        """Per op of a forward: its [B, T] row hashes in each forward."""
        for f in self.forwards:
            if [k for k, _ in f] != self.expected:
                raise RuntimeError("lockstep bisect: a forward's op sequence is not models/layer.py's; update "
                                   f"launch/bisect.py LAYER_OPS (saw {[k for k, _ in f][:20]} ...)")
        return [[f[i][1] for f in self.forwards] for i in range(len(self.expected))]


@dataclass
class OpRow:
    layer: int | None  # None: before the layers (RoPE tables) or after them (final norm, logprob)
    op: str
    slot: str
    trainer_impl: str
    rollout_impl: str
    trainer_hash: str
    rollout_hash: str
    rows: int
    rows_differ: int
    first_row: int | None  # the first token position whose row differs


def _digest(h: torch.Tensor) -> str:
    return hashlib.sha1(h.numpy().tobytes()).hexdigest()[:12]


def _names(num_layers: int) -> list[tuple[int | None, str, str]]:
    return ([(None, "rope cos/sin", "attention.rope_cos_sin")]
            + [(i, what, slot) for i in range(num_layers) for slot, what in LAYER_OPS]
            + [(None, "final norm", "logp.rms_norm")])


@dataclass
class Bisection:
    step: int
    sample: int
    prompt_len: int
    response_len: int
    device: str
    dtype: str
    kernel_backend: str
    reproduces: dict  # side -> the replay's logprobs equal the run's (bitwise)
    ops: list[OpRow]
    logp_differ: int
    logp_first: int | None
    first: OpRow | None  # the first op that differs (None: no op does)
    notes: list[str]


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float().contiguous().view(torch.int32) != b.float().contiguous().view(torch.int32)


def bisect(run_dir: str | Path, step: int, sample: int | None = None, device: str | None = None) -> Bisection:
    from lockstep.framework.actor.logp import model_logp
    from lockstep.framework.consistency.readback import load_readbacks
    from lockstep.framework.consistency.record import read_record
    from lockstep.framework.models.ops import ops_for_side
    from lockstep.framework.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
    from lockstep.framework.rollout.native import NativeRolloutEngine
    import lockstep.kernels as K

    run_dir = Path(run_dir)
    rec = read_record(run_dir, step)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    det, notes = cfg["determinism"], []
    ro = rec.rollout
    if sample is None:
        sample = rec.mismatching_samples[0] if rec.mismatching_samples else 0
    if not 0 <= sample < ro.batch_size:
        raise ValueError(f"--sample {sample}: step {step} has samples 0..{ro.batch_size - 1}")
    want = cfg["parallel"]["device"]
    device = device or (want if want == "cpu" or torch.cuda.is_available() else "cpu")
    if device != want:
        notes.append(f"replayed on {device}; the run computed on {want}")
    backends = {rb.get("kernel_backend") for rb in load_readbacks(run_dir) if "R" in rb["selection"].values()} - {None}
    backend = K.get_backend()
    if len(backends) == 1 and (b := backends.pop()) != backend:
        try:
            K.set_backend(b)
            backend = b
        except (RuntimeError, ValueError) as e:
            notes.append(f"the run's kernel backend {b!r} cannot run here ({e}); replayed on {backend!r}")
    dtype = getattr(torch, cfg["model"]["dtype"])
    model_config = asdict(Qwen3Config.from_dir(rec.weights))

    trainer_ops = ops_for_side(det, "trainer")
    trainer = Qwen3ForCausalLM.from_pretrained(rec.weights, trainer_ops).to(device, dtype).eval()
    # the replay feeds the recorded tokens and ends rows at their recorded lengths: no id is EOS to it
    engine = NativeRolloutEngine(model_config, determinism=det, real_vocab_size=rec.real_vocab_size, eos_ids=[-1],
                                 pad_id=0, device=device, dtype=cfg["model"]["dtype"])
    engine.model.load_hf_state_dict(trainer.hf_state_dict())
    layers = model_config["num_hidden_layers"]
    traces = {"trainer": Tracer(layers), "rollout": Tracer(layers)}
    trainer_ops.counter.tap, engine.ops.counter.tap = traces["trainer"].tap, traces["rollout"].tap

    # both sides replay the whole recorded batch, as the run computed it (stock ops are not batch-invariant)
    p, r = int(ro.prompt_lens[sample]), int(ro.response_lens[sample])
    with torch.no_grad():
        t_logp = model_logp(trainer, ro, torch.arange(ro.batch_size), real_vocab_size=rec.real_vocab_size,
                            with_entropy=False).logp[sample, :r].cpu()
    r_logp = engine.replay(ro)[sample, :r].cpu()
    reproduces = {"trainer": not bool(_bits_differ(t_logp, rec.trainer_logp[sample, :r]).any()),
                  "rollout": not bool(_bits_differ(r_logp, ro.logp[sample, :r]).any())}
    for side, ok in reproduces.items():
        if not ok:
            where = cfg["actor" if side == "trainer" else "rollout"]["backend"]
            notes.append(f"the {side} replay does not reproduce the run's {side} logprobs: what the run saw there "
                         f"comes from the {where} backend's own code or batch, outside the ops replayed here")

    # trainer rows 0..L-2 are the states the rollout computed (the last response token is never fed)
    seen = p + r - 1
    t_ops, r_ops = traces["trainer"].per_op(), traces["rollout"].per_op()
    rows = []
    for (layer, what, slot), t_fwd, r_fwd in zip(_names(layers), t_ops, r_ops):
        # the trainer's one forward; the rollout's prefill (the prompt's rows), then one row per decode step
        th = t_fwd[0][sample, :seen]
        rh = torch.cat([r_fwd[0][sample, :p], *[f[sample, :1] for f in r_fwd[1:r]]])
        differ = (th != rh).nonzero()[:, 0]
        rows.append(OpRow(layer, what, slot, trainer_ops.counter.impl[slot], engine.ops.counter.impl[slot],
                          _digest(th), _digest(rh), seen, int(differ.numel()),
                          int(differ[0]) if differ.numel() else None))
    lp_differ = _bits_differ(t_logp, r_logp).nonzero()[:, 0]
    first = next((row for row in rows if row.rows_differ), None)
    fault = det.get("inject_fault", "none")
    logp_row = OpRow(None, "token logprob", "logp.linear_logp", trainer_ops.counter.impl["logp.linear_logp"],
                     f"fault:{fault}" if fault != "none" else engine.ops.counter.impl["logp.linear_logp"],
                     _digest(t_logp.view(torch.int32)), _digest(r_logp.view(torch.int32)), r, int(lp_differ.numel()),
                     int(lp_differ[0]) if lp_differ.numel() else None)
    rows.append(logp_row)
    if first is None and logp_row.rows_differ:
        first = logp_row
    return Bisection(step, sample, p, r, device, cfg["model"]["dtype"], backend, reproduces, rows,
                     int(lp_differ.numel()), int(lp_differ[0]) if lp_differ.numel() else None, first, notes)


def _where(row: OpRow) -> str:
    return f"layer {row.layer} {row.op}" if row.layer is not None else row.op


def format_bisection(b: Bisection, run_dir, show_all: bool = False) -> str:
    out = [f"lockstep bisect {run_dir}: step {b.step}, sample {b.sample} (prompt {b.prompt_len} tokens, "
           f"response {b.response_len})",
           f"replay on {b.device}, {b.dtype}, kernels {b.kernel_backend}; reproduces the run's logprobs: "
           + ", ".join(f"{side} {'yes' if ok else 'NO'}" for side, ok in b.reproduces.items())]
    if b.first is None:
        out.append("no op differs between the sides, nor the logprob")
    else:
        f = b.first
        unit = "logprobs" if f.slot == "logp.linear_logp" else "token rows"
        pos = (f"response position {f.first_row}" if f.slot == "logp.linear_logp" else f"position {f.first_row}")
        n_before = b.ops.index(f)
        out.append(f"first difference: {_where(f)} ({f.slot}): trainer {f.trainer_impl} vs rollout {f.rollout_impl}; "
                   f"{f.rows_differ} of {f.rows} {unit} differ, the first at {pos} "
                   f"({n_before} ops before it agree)")
    shown = b.ops if show_all else [r for r in b.ops if r.rows_differ][:8]
    if shown:
        out.append(f"\n{'layer':>5}  {'op':<26} {'slot':<22} {'trainer':<14} {'rollout':<14} differ")
        for r in shown:
            layer = "-" if r.layer is None else str(r.layer)
            out.append(f"{layer:>5}  {r.op:<26} {r.slot:<22} {r.trainer_hash:<14} {r.rollout_hash:<14} "
                       f"{r.rows_differ}/{r.rows}")
        if not show_all:
            out.append("(the first ops that differ; --all lists every op with its hashes)")
    out += [f"note: {n}" for n in b.notes]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lockstep bisect", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--step", type=int, required=True, help="a recorded step (RUN_DIR/bisect/step-N)")
    ap.add_argument("--sample", type=int, default=None, help="the sample to replay (default: the first that mismatched)")
    ap.add_argument("--device", default=None, help="replay device (default: the run's, cpu without a GPU)")
    ap.add_argument("--all", action="store_true", help="list every op with its per-side hashes")
    args = ap.parse_args(argv)
    if not (Path(args.run_dir) / "config.yaml").exists():
        print(f"lockstep bisect: {args.run_dir}: not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    try:
        result = bisect(args.run_dir, args.step, args.sample, args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"lockstep bisect: {e}", file=sys.stderr)
        return 2
    from lockstep.framework.consistency.record import record_dir

    (record_dir(args.run_dir, args.step) / f"bisect-sample-{result.sample}.json").write_text(
        json.dumps(asdict(result), indent=1))
    print(format_bisection(result, args.run_dir, args.all))
    return 0
