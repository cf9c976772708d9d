"""Reading a compiled program's HLO text: its collectives (how many, how many bytes each
moves per step), its memory traffic and its largest buffers.

Collectives run as often as the computation holding them: a `while` body with a known trip
count (gradient accumulation's scan) counts that many times; a loop whose count is decided at
run time (a decoding loop that stops when every row is done) counts once, flagged `per_iteration`.

Bytes per collective are the array it reduces or produces, per device: all-reduce its operand,
all-gather its output, reduce-scatter its input (output x group), all-to-all and permute their
operand. `sent` is what one device puts on the wire with ring algorithms (all-reduce
2 (g-1)/g of the array, all-gather and reduce-scatter (g-1)/g, all-to-all (g-1)/g, permute 1),
which the roofline divides by the chip's interconnect bandwidth.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {
    **dict.fromkeys(["pred", "s8", "u8", "f8e4m3fn", "f8e5m2"], 1),
    **dict.fromkeys(["s16", "u16", "f16", "bf16"], 2),
    **dict.fromkeys(["s32", "u32", "f32"], 4),
    **dict.fromkeys(["s64", "u64", "f64", "c64"], 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")  # a layout's memory space; none or S(0) is HBM
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NOT_BUFFERS = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    type_text: str  # the result type, e.g. 'bf16[8,512]{1,0}' or a tuple
    rest: str  # operands and attributes

    def arrays(self, hbm_only: bool = False) -> list[int]:
        """Bytes of each array in the result type, in order; with `hbm_only`, those placed
        in another memory space (TPU layouts' S(n), n > 0: on-chip memories) count 0."""
        out = []
        for dtype, dims, layout in _ARRAY.findall(self.type_text):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            space = _SPACE.search(layout)
            on_chip = hbm_only and space is not None and space.group(1) != "0"
            out.append(0 if on_chip else n * _BYTES[dtype])
        return out


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    multiplicity: dict[str, int]  # how many times each computation runs per execution
    unknown_trip: set[str]  # computations inside a loop whose trip count is not static


def parse(text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(2)
                computations[current] = []
                entry = current if m.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        body = m.group(2)
        op = _OPCODE.search(" " + body)
        if op is None:
            continue
        start, end = op.start() - 1, op.end() - 1  # offsets in `body` (searched with a space)
        computations[current].append(
            Instruction(m.group(1), op.group(1), body[: max(start, 0)].strip(), body[end:])
        )
    multiplicity, unknown = _multiplicities(computations, entry)
    return Module(computations, entry, multiplicity, unknown)


def _edges(instruction: Instruction) -> list[tuple[str, int | None]]:
    """(callee, times per call; None: a loop of unknown count) of one instruction."""
    out: list[tuple[str, int | None]] = []
    trip = None
    if instruction.opcode == "while":
        m = _TRIP.search(instruction.rest)
        trip = int(m.group(1)) if m else None
    for key, name in _CALLS.findall(instruction.rest):
        out.append((name, trip if key in ("body", "condition") else 1))
    for group in _BRANCHES.findall(instruction.rest):
        out += [(b.strip().lstrip("%"), 1) for b in group.split(",") if b.strip()]
    return out


def _multiplicities(computations, entry):
    mult: dict[str, int] = collections.defaultdict(int)
    unknown: set[str] = set()

    def visit(name: str, times: int, in_unknown: bool) -> None:
        mult[name] += times
        if in_unknown:
            unknown.add(name)
        for ins in computations.get(name, []):
            for callee, per in _edges(ins):
                if callee in computations:
                    visit(callee, times * (per or 1), in_unknown or per is None)

    if entry:
        visit(entry, 1, False)
    return dict(mult), unknown


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS and not opcode.endswith("-done") else None


def _group_size(rest: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)  # iota form [groups,size]<=[...]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return num_devices


def _moved(kind: str, opcode: str, arrays: list[int], group: int) -> tuple[int, float]:
    """(bytes of the collective's array, bytes one device sends) for one execution."""
    if opcode.endswith("-start") and kind in ("all-gather", "collective-permute") and arrays:
        # async starts return (operands..., outputs...[, context]): keep one side
        half = len(arrays) // 2
        arrays = arrays[half : 2 * half] if kind == "all-gather" else arrays[:1]
    size = sum(arrays)
    g = max(group, 1)
    if kind == "reduce-scatter":
        size *= g
    factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(kind, (g - 1) / g)
    return size, size * factor


def collectives(module: Module, num_devices: int) -> dict[str, dict]:
    """kind -> {'count', 'bytes', 'sent', 'per_iteration'} per execution of the program."""
    out = {k: {"count": 0, "bytes": 0, "sent": 0.0, "per_iteration": False} for k in KINDS}
    for name, instructions in module.computations.items():
        times = module.multiplicity.get(name, 0)
        for ins in instructions:
            kind = _kind(ins.opcode)
            if kind is None or not times:
                continue
            size, sent = _moved(kind, ins.opcode, ins.arrays(), _group_size(ins.rest, num_devices))
            entry = out[kind]
            entry["count"] += times
            entry["bytes"] += size * times
            entry["sent"] += sent * times
            entry["per_iteration"] |= name in module.unknown_trip
    return out


_NO_TRAFFIC = (
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
)
_NAME = re.compile(r"%([\w.\-]+)")


def _control(module: Module) -> set[str]:
    """The computations that run as programs (entry, loop bodies, branches), not fusion
    bodies, whose instructions stay on chip."""
    names = {module.entry}
    for instructions in module.computations.values():
        for ins in instructions:
            if ins.opcode in ("while", "conditional", "call"):
                names.update(callee for callee, _ in _edges(ins))
    return names


def loop_trips(module: Module) -> int:
    """The most times any loop body or branch of the program runs per execution (1: no loop
    runs more than once). The compiler's cost analysis counts such a body once."""
    return max((module.multiplicity.get(name, 0) for name in _control(module)), default=1)


def _operands(rest: str) -> list[str]:
    """The operand names of an instruction: its argument list up to the closing paren."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return _NAME.findall(rest[:end])


# Custom calls that move no data: views and allocations of XLA:TPU's own.
_FREE_CALLS = ("ConcatBitcast", "AllocateBuffer", "AssumeGatherIndicesInBound")


def _traffic(module: Module, custom_calls_only: bool = False):
    """(bytes per execution, instruction) of each top-level operation that moves HBM data:
    hbm_traffic's terms."""
    for name in _control(module):
        times = module.multiplicity.get(name, 0)
        instructions = module.computations.get(name, [])
        hbm = {ins.name: sum(ins.arrays(hbm_only=True)) for ins in instructions}
        every = {ins.name: sum(ins.arrays()) for ins in instructions}
        for ins in instructions:
            if ins.opcode in _NO_TRAFFIC or ins.opcode.endswith("-done"):
                continue
            target = _TARGET.search(ins.rest) if ins.opcode == "custom-call" else None
            if target and target.group(1) in _FREE_CALLS:
                continue
            if custom_calls_only and not target:
                continue
            operands = set(_operands(ins.rest))  # an operand passed twice is read once
            if ins.opcode.endswith("-start"):
                # an async copy or slice: its result tuple repeats the operands, then holds the
                # destination, read from HBM and, when the destination is HBM, written there
                dest = sum(ins.arrays()) - sum(every.get(o, 0) for o in operands)
                dest_hbm = sum(ins.arrays(hbm_only=True)) - sum(hbm.get(o, 0) for o in operands)
                yield times * (max(dest, 0) + max(dest_hbm, 0)), ins
                continue
            read = sum(hbm.get(o, 0) for o in operands)
            yield times * (read + sum(ins.arrays(hbm_only=True))), ins


def hbm_traffic(module: Module, custom_calls_only: bool = False) -> int:
    """Bytes the program's top-level operations read from and write to HBM per execution:
    each fusion, matmul, kernel, copy or collective reads its operands and writes its result
    (what stays inside a fusion never reaches memory; operands and results the TPU compiler
    placed in on-chip memory, S(n) layouts, are not HBM traffic, only their copy from HBM is).
    An estimate: an operation that reads only part of an operand (a slice, a gather) is
    counted with all of it, one that reads an operand several times once.
    custom_calls_only: count the kernels called by name alone (cuDNN's, Pallas'), which XLA's
    cost analysis cannot look into."""
    return sum(b for b, _ in _traffic(module, custom_calls_only))


def _inner_opcodes(module: Module, ins: Instruction) -> set[str]:
    """The opcodes inside a fusion, through the fusions nested in it (XLA:TPU nests them)."""
    seen, out = set(), set()
    todo = [name for _, name in _CALLS.findall(ins.rest)]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for inner in module.computations.get(name, []):
            out.add(inner.opcode)
            todo += [callee for _, callee in _CALLS.findall(inner.rest)]
    return out


def _traffic_kind(ins: Instruction, module: Module) -> str:
    """What an operation is, in a few words: the kernel a custom call names, a matmul (a dot
    or convolution, fused or not), an elementwise or reduction fusion, a collective, a copy,
    a slice, gather or scatter; 'other' for the rest."""
    if ins.opcode == "custom-call":
        target = _TARGET.search(ins.rest)
        name = target.group(1) if target else ""
        if "cublas" in name or "gemm" in name.lower():
            return "matmuls"
        if name.startswith("__cudnn$fmha"):
            return "attention (cuDNN)"
        if "triton" in name or name in ("tpu_custom_call", "mosaic_gpu"):
            return "Pallas kernels"
        return f"custom call {name}"
    opcode = ins.opcode.removesuffix("-start")
    if opcode in ("dot", "convolution"):
        return "matmuls"
    if _kind(ins.opcode):
        return "collectives"
    if opcode in ("copy", "transpose"):
        return "copies"
    if opcode in ("scatter", "gather", "slice", "dynamic-slice", "dynamic-update-slice"):
        return "slices, gathers, scatters"
    if opcode != "fusion":
        return "other"
    inner = _inner_opcodes(module, ins)
    if inner & {"dot", "convolution"}:  # XLA:GPU's GEMM fusions, XLA:TPU's output fusions
        return "matmuls"
    if inner & {"scatter", "gather"}:
        return "slices, gathers, scatters"
    if inner & {"reduce", "reduce-window"}:
        return "reductions"
    if inner and inner <= {"parameter", "copy", "transpose", "bitcast", "tuple"}:
        return "copies"
    return "elementwise"


def traffic_split(module: Module, n: int = 10) -> tuple[dict[str, int], list[dict]]:
    """hbm_traffic split by what the operations are (_traffic_kind), largest first, and the
    `n` operations moving the most bytes with the JAX operation that made them
    (largest_buffers' form): where a step's bytes go, the question each HBM lever starts
    from. One pass: classifying a fusion walks its body."""
    by_kind: dict[str, int] = collections.Counter()
    ops = []
    for b, ins in _traffic(module):
        kind = _traffic_kind(ins, module)
        by_kind[kind] += b
        m = _OP_NAME.search(ins.rest)
        ops.append(
            {"bytes": b, "kind": kind, "opcode": ins.opcode, "op": m.group(1) if m else ins.name}
        )
    ranked = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
    return ranked, sorted(ops, key=lambda x: -x["bytes"])[:n]


_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def custom_calls(module: Module) -> dict[str, int]:
    """Kernels the program calls by name (cuDNN attention, Pallas/Mosaic kernels), counted
    per execution as collectives are."""
    out: dict[str, int] = collections.Counter()
    for name, instructions in module.computations.items():
        for ins in instructions:
            m = _TARGET.search(ins.rest) if ins.opcode == "custom-call" else None
            if m and module.multiplicity.get(name, 0):
                out[m.group(1)] += module.multiplicity[name]
    return dict(out)


def largest_buffers(module: Module, n: int = 5) -> list[dict]:
    """The `n` largest arrays the program's control flow materialises (fusion internals are
    not buffers), with the JAX operation that made them."""
    found = []
    for name in _control(module):
        for ins in module.computations.get(name, []):
            if ins.opcode in _NOT_BUFFERS or ins.type_text.startswith("("):
                continue  # tuples and control ops alias the buffers they hold
            size = sum(ins.arrays())
            m = _OP_NAME.search(ins.rest)
            found.append(
                {
                    "bytes": size,
                    "shape": ins.type_text.split("{")[0],
                    "opcode": ins.opcode,
                    "op": m.group(1) if m else ins.name,
                }
            )
    return sorted(found, key=lambda b: -b["bytes"])[:n]
