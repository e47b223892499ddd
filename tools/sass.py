"""SASS analysis of compiled Triton kernels (no GPU needed: the triton wheel ships cuobjdump):
registers, spills, occupancy and the instruction mix of a kernel's main loop."""

from __future__ import annotations

# SASS instructions of the integer/compare/select ("ALU") pipe, half rate on sm_90: the per-block
# row max (FMNMX) and the top-k network (FSETP/FSEL/SEL) run here
ALU_OPS = ("FMNMX", "SEL", "FSEL", "FSETP", "ISETP", "IADD3", "LOP3", "SHF", "VIMNMX", "P2R", "R2P", "PLOP3",
            "IMNMX", "LEA", "PRMT", "VIADD", "IABS", "BMSK")


def sass_loops(sass: str, mma: tuple[str, ...] = ("GMMA",)) -> list[list[tuple[int, str]]]:
    """Bodies (address, opcode) of the backward-branch loops holding an opcode that contains one of
    `mma` (default: a wgmma of any type, HGMMA, QGMMA, ...), smallest first."""
    import re

    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    addr = {a: i for i, (a, _, _) in enumerate(ins)}
    loops = []
    for i, (a, op, rest) in enumerate(ins):
        m = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in addr:
            body = [(x, o) for x, o, _ in ins[addr[int(m.group(1), 16)]: i + 1]]
            if any(key in o for _, o in body for key in mma):
                loops.append(body)
    return sorted(loops, key=len)


def resource_usage(compiled, num_warps: int | None = None) -> dict:
    """Registers, spill stack, shared memory, occupancy and the main loop of a compiled kernel.

    main_loop_*: the smallest loop holding the wgmma (the unmasked key-block loop): its SASS
    instruction count, ALU-pipe instructions (`ALU_OPS`), wgmma instructions, wgmma waits
    (WARPGROUP.DEPBAR), CTA barriers, and `wait_then_alu`: the wait comes right after the last
    wgmma of the block, before the block's reduction (no MMA/ALU overlap inside a warpgroup).
    """
    import re

    from msakit.ops.index_topk.triton import shfl_layouts_ok
    from tools.cuda_compile import cuobjdump

    res, sass = cuobjdump(compiled)
    reg = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    regs = int(reg.group(1)) if reg else -1
    shared = int(compiled.metadata.shared)
    warps = num_warps or int(compiled.metadata.num_warps)
    # CTAs per SM: 64K registers (per-warp allocation in 256-register units), 228 KiB shared
    # memory (+1 KiB reserved per CTA), 64 warps
    reg_warp = -(-max(regs, 1) * 32 // 256) * 256
    ctas = min(65536 // (reg_warp * warps), (228 * 1024) // (shared + 1024), 64 // warps)
    row = {
        "regs": regs,
        "stack": int(stack.group(1)) if stack else -1,
        "shared": shared,
        "ctas_per_sm": ctas,
        "local_loads": sass.count("LDL"),
        "gmma": sass.count("HGMMA") + sass.count("QGMMA"),
        "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local"),
        "tma_copies": compiled.asm["ttgir"].count("async_tma_copy_global_to_local"),
        "shfl_layout_ok": shfl_layouts_ok(compiled.asm["ttgir"]),
    }
    loops = sass_loops(sass)
    if loops:
        body = loops[0]
        ops = [o.split(".")[0] for _, o in body]
        last_mma = max(i for i, o in enumerate(ops) if o in ("HGMMA", "QGMMA"))
        waits = [i for i, (_, o) in enumerate(body) if o.startswith("WARPGROUP.DEPBAR")]
        first_max = next((i for i, o in enumerate(ops) if o == "FMNMX" and i > last_mma), None)
        row.update(
            main_loop_instrs=len(body),
            main_loop_alu=sum(o in ALU_OPS for o in ops),
            main_loop_gmma=sum(o in ("HGMMA", "QGMMA") for o in ops),
            main_loop_waits=len(waits),
            main_loop_bars=ops.count("BAR"),
            wait_then_alu=bool(waits) and first_max is not None and any(last_mma < w < first_max for w in waits),
        )
    return row
