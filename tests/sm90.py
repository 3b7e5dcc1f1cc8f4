"""Compiling Triton kernels for Hopper (sm_90a) on a machine without a GPU: what the MMA
instructions are and how many registers ptxas gives a kernel. Runs in a subprocess without
TRITON_INTERPRET (the interpreter compiles nothing); `probe` is what the tests call."""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def compile_sm90(kernel, types, constexprs: dict, num_warps: int, num_stages: int, count: tuple = (),
                 wgmma_loops: bool = False) -> dict:
    """types(arg name) -> Triton signature type of every non-constexpr argument. Returns the MMA
    (version, instruction shape) pairs of the TTGIR, ptxas' registers and spilled bytes, whether
    the kernel was warp-specialised (a ttg.warp_specialize op: producer and consumer partitions), its
    shared memory and, under "ptx", how many PTX instructions (guarded or not) begin with each opcode
    in `count`; with wgmma_loops, under "wgmma_loops", each innermost SASS loop that issues wgmmas
    (HGMMA) as {"instructions", "spills": its local-memory loads and stores}. A Gluon kernel
    (gluon.jit) compiles from its own source; its tensor descriptors' types name their shared layout
    ("tensordesc<bf16[64, 64],NVMMASharedLayout(...)>")."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    # constexpr parameters left out take their defaults, as at a launch
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    names = [n for n in kernel.arg_names if n not in constexprs]
    sig = {n: types(n) for n in names}
    # what the launcher's specialisation tells the compiler: 16-byte aligned pointers and strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*" or n.startswith("stride")}
    source = GluonASTSource if getattr(kernel, "is_gluon", lambda: False)() else ASTSource
    compiled = triton.compile(source(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    mma = sorted(set(re.findall(r"nvidia_mma<\{versionMajor = (\d).*?instrShape = (\[[\d, ]+\])",
                                compiled.asm["ttgir"])))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(ptxas.parent / "nvdisasm"), "-c", str(Path(tmp) / "k.cubin")], capture_output=True,
                              text=True, check=True).stdout if wgmma_loops else ""
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    # each instruction's opcode, past a predicate guard ("@%p1 cp.async.bulk...")
    ops = [words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
           for words in (line.split() for line in compiled.asm["ptx"].splitlines() if line.strip() and line[0] in " \t")]
    return {"mma": mma, "regs": int(regs.group(1)), "spill_bytes": int(spills.group(1)) if spills else 0,
            "warp_specialized": "ttg.warp_specialize(" in compiled.asm["ttgir"],
            "shared_bytes": compiled.metadata.shared, "ptx": {op: sum(o.startswith(op) for o in ops) for op in count},
            **({"wgmma_loops": _wgmma_loops(sass)} if wgmma_loops else {})}


def _wgmma_loops(sass: str) -> list[dict]:
    """The innermost loops of nvdisasm's listing (a backward branch to a label, around no other)
    whose bodies issue HGMMA."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i]
    loops = []
    for a, b in spans:
        if any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans):
            continue
        body = [line for line in lines[a:b + 1] if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
        if any("HGMMA" in line for line in body):
            loops.append({"instructions": len(body),
                          "spills": sum(bool(re.search(r"\b(LDL|STL)\b", line)) for line in body)})
    return loops


def probe(code: str):
    """Run `code` (which prints one JSON line last) in a fresh interpreter that compiles for sm_90."""
    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])
