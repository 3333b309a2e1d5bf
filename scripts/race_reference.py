#!/usr/bin/env python3
"""Race the reference TwELL kernels against PyTorch, the way twell times itself.

The reference is Sakana AI's public sparser-faster-llms repository (MIT): its
inference extension (custom_models/twell_modules: the fused gated MLP, a D2T
gate GEMM with a ReLU+pack epilogue, then the gated T2D kernel) and its
training extension (custom_models/hybrid_modules: torch.ops.sparse_ops.
ff_forward_gated with autograd). This script builds both with PyTorch's
cpp_extension and times them, in one process per measurement, next to the
PyTorch dense gated MLP (bf16), with twell's method: the paths take turns, a
buffer twice the size of L2 is written before every timed call, CUDA events
around each call, 3 warm-up calls per path, median of --reps; input batches
rotate (as many as twell's bench ffn uses). Every MLP's output is checked
against a float64 reference on the token rows twell checks and against an
fp32 reference on all rows. The reference's D2T is also timed alone (its
packed gate), its mean active count recorded beside the fp32 gate's.

A measurement that kills its process (the reference's hybrid kernel was seen
to segfault at 2% density) is recorded as a crash, and the paths left are
timed again in a fresh process.

    race_reference.py build  --ref REF --build-dir DIR
    race_reference.py ffn    --ref REF --build-dir DIR (--inputs DUMP | --synth)
                             --m M --density P [--dist D] --out FILE [--logs DIR]
    race_reference.py train  --ref REF --build-dir DIR --m M --density P [--dist D]
                             --out FILE [--logs DIR]
    race_reference.py report OUTDIR

ffn and train add their figures to the JSON file --out (schema
twell.race.reference/1), replacing an earlier entry of the same shape. report
merges OUTDIR/reference.json with twell's JSON files there (twell-ffn-*.json,
twell-train-*.json) into OUTDIR/race.json and OUTDIR/race.md and prints the
table. scripts/race-reference.sh drives all of it; build, ffn and train need
torch and a GPU, report only the standard library.
"""
import argparse
import datetime
import glob
import hashlib
import json
import math
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import time

REFERENCE_SCHEMA = "twell.race.reference/1"
RACE_SCHEMA = "twell.race/1"
D2T_TILE = 256  # the reference's TwELL tile width
D2T_SLOTS = 31  # payload slots per tile at compression 8

# The reference sources each extension is built from, relative to the
# checkout, and the flags, as twell.py's load_ext (algorithm "twell_mlp" and
# its dependencies) and hybrid_modules/sparse_ops_loader.py (a Hopper target,
# profiling off) give them; both link -lcuda from the toolkit's stubs and
# compile for TORCH_CUDA_ARCH_LIST=9.0a.
TWELL_SOURCES = [
    "custom_models/twell_modules/matmul_d2t.cu",
    "custom_models/twell_modules/matmul_t2d.cu",
    "custom_models/twell_modules/matmul_gated_t2d.cu",
    "custom_models/twell_modules/mlp_twell.cu",
    "custom_models/twell_modules/twell.cpp",
]
HYBRID_SOURCES = [
    "custom_models/hybrid_modules/custom_op.cpp",
    "custom_models/hybrid_modules/hybrid_sp.cu",
    "custom_models/hybrid_modules/wgmma_gemm.cu",
    "custom_models/twell_modules/matmul_d2t.cu",
]
EXTENSIONS = {
    # name: (module name, sources, C++ flags, nvcc flags, a Python module?)
    "twell": (
        "race_ref_twell",
        TWELL_SOURCES,
        ["-O3"],
        ["-O3", "--use_fast_math", "--expt-relaxed-constexpr", "--expt-extended-lambda"],
        True,
    ),
    "hybrid": (
        "race_ref_sparse_ops",
        HYBRID_SOURCES,
        ["-O3", "-DENABLE_PERF_PROFILING=0"],
        [
            "-DNDEBUG",
            "-O3",
            "-Xcompiler=-Wno-psabi",
            "-Xcompiler=-fno-strict-aliasing",
            "--resource-usage",
            "--expt-relaxed-constexpr",
            "-DENABLE_PERF_PROFILING=0",
        ],
        False,
    ),
}
# Headers the sources include; they count in the build stamp.
HEADER_GLOBS = ["custom_models/twell_modules/*.h", "custom_models/twell_modules/*.cuh",
                "custom_models/hybrid_modules/*.h", "custom_models/hybrid_modules/*.cuh"]

BASELINE = {"ffn": "torch_dense", "train": "torch_dense_autograd"}
PATHS = {"ffn": ["torch_dense", "reference_twell", "reference_d2t"], "train": ["torch_dense_autograd", "reference_hybrid"]}


def now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def say(*a):
    print("race_reference:", *a, file=sys.stderr, flush=True)


def write_json(path, obj):
    """Writes obj to path through a temporary file and a rename."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


# --------------------------------------------------------------------------
# The reference checkout


def ref_commit(ref):
    """The reference commit: the first word of ref/COMMIT, else git's HEAD
    when ref is the top of a git work tree (not a folder inside another
    repository), else "unknown"."""
    try:
        with open(os.path.join(ref, "COMMIT")) as f:
            words = f.read().split()
            if words:
                return words[0]
    except OSError:
        pass
    try:
        git = lambda *a: subprocess.run(["git", "-C", ref, *a], capture_output=True, text=True, timeout=30)  # noqa: E731
        top = git("rev-parse", "--show-toplevel")
        if top.returncode == 0 and os.path.realpath(top.stdout.strip()) == os.path.realpath(ref):
            head = git("rev-parse", "HEAD")
            if head.returncode == 0 and head.stdout.strip():
                return head.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def sources_digest(ref, rels):
    """sha256 over the named files and the headers beside them."""
    files = sorted(set(rels) | {os.path.relpath(p, ref) for g in HEADER_GLOBS for p in glob.glob(os.path.join(ref, g))})
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(ref, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def check_ref(ref):
    need = dict.fromkeys(TWELL_SOURCES + HYBRID_SOURCES + ["custom_models/twell_modules/twell.py"])
    missing = [r for r in need if not os.path.isfile(os.path.join(ref, r))]
    if missing:
        sys.exit(f"race_reference: {ref} is not a checkout of the reference: {', '.join(missing)} missing")


def reference_info(ref):
    return {
        "path": os.path.abspath(ref),
        "commit": ref_commit(ref),
        "twell_sources_sha256": sources_digest(ref, TWELL_SOURCES),
        "hybrid_sources_sha256": sources_digest(ref, HYBRID_SOURCES),
    }


# --------------------------------------------------------------------------
# Building the extensions


def cmd_build(a):
    check_ref(a.ref)
    os.makedirs(a.build_dir, exist_ok=True)
    which = ["twell", "hybrid"] if a.only == "both" else [a.only]
    procs = {}
    for w in which:
        log = open(os.path.join(a.build_dir, f"build-{w}.log"), "w")
        cmd = [sys.executable, os.path.abspath(__file__), "_build_one", w, "--ref", a.ref, "--build-dir", a.build_dir]
        say(f"building the {w} extension (log {log.name})")
        procs[w] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, time.time())
    failed = []
    for w, (p, log, t0) in procs.items():
        rc = p.wait()
        log.close()
        stamp = read_json(os.path.join(a.build_dir, w, "stamp.json"), {})
        if rc == 0 and stamp.get("so"):
            say(f"{w}: {stamp['so']} ({stamp.get('how', '?')}, {time.time() - t0:.0f} s)")
        else:
            failed.append(w)
            say(f"{w}: build FAILED (exit {rc}); the last lines of {log.name}:")
            with open(log.name, errors="replace") as f:
                for line in f.readlines()[-25:]:
                    print("    " + line.rstrip(), file=sys.stderr)
    return 1 if failed else 0


def build_one(a):
    """Builds one extension into build_dir/NAME: setuptools with torch's
    BuildExtension (which uses ninja when it is installed and compiles one
    file after another when not); torch's JIT loader when setuptools is
    missing (it needs ninja)."""
    import torch
    import torch.utils.cpp_extension as ce

    os.environ["TORCH_CUDA_ARCH_LIST"] = os.environ.get("RACE_CUDA_ARCH", "9.0a")
    if os.environ.get("RACE_IGNORE_CUDA_VERSION") == "1" and hasattr(ce, "_check_cuda_version"):
        ce._check_cuda_version = lambda *x, **k: say("nvcc/torch CUDA version check skipped (RACE_IGNORE_CUDA_VERSION=1)")
    if ce.CUDA_HOME is None:
        sys.exit("race_reference: no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    modname, rels, cflags, nvflags, pymod = EXTENSIONS[a.what]
    srcs = [os.path.abspath(os.path.join(a.ref, r)) for r in rels]
    out = os.path.abspath(os.path.join(a.build_dir, a.what))
    want = {
        "name": modname,
        "sources_sha256": sources_digest(a.ref, rels),
        "cflags": cflags,
        "nvcc_flags": nvflags,
        "arch": os.environ["TORCH_CUDA_ARCH_LIST"],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    stamp_path = os.path.join(out, "stamp.json")
    old = read_json(stamp_path, {})
    if old.get("so") and os.path.isfile(old["so"]) and all(old.get(k) == v for k, v in want.items()):
        print(f"{a.what}: up to date ({old['so']})")
        return 0
    if os.path.exists(stamp_path):
        os.remove(stamp_path)
    os.makedirs(out, exist_ok=True)
    stubs = os.path.join(ce.CUDA_HOME, "lib64", "stubs")
    print(f"{a.what}: {modname} from {len(srcs)} files, TORCH_CUDA_ARCH_LIST={want['arch']}, "
          f"CUDA_HOME={ce.CUDA_HOME}, ninja {'found' if ce.is_ninja_available() else 'not found'}", flush=True)
    try:
        import setuptools
    except ImportError:
        setuptools = None
    if setuptools is not None:
        os.chdir(out)  # no project file of the caller's folder is read
        ext = ce.CUDAExtension(
            name=modname,
            sources=srcs,
            extra_compile_args={"cxx": cflags, "nvcc": nvflags},
            library_dirs=[stubs],
            libraries=["cuda"],
        )
        setuptools.setup(
            name=modname,
            ext_modules=[ext],
            cmdclass={"build_ext": ce.BuildExtension.with_options(no_python_abi_suffix=True)},
            script_args=["build_ext", "--build-lib", out, "--build-temp", os.path.join(out, "tmp")],
        )
        how = "setuptools, " + ("ninja" if ce.is_ninja_available() else "no ninja")
        found = sorted(glob.glob(os.path.join(out, modname + "*.so")))
        if not found:
            sys.exit(f"race_reference: the build left no {modname}*.so in {out}")
        so = found[0]
    else:
        if not ce.is_ninja_available():
            sys.exit("race_reference: neither setuptools nor ninja is installed; one of them is needed to build")
        ce.load(name=modname, sources=srcs, extra_cflags=cflags, extra_cuda_cflags=nvflags,
                extra_ldflags=[f"-L{stubs}", "-lcuda"], build_directory=out, verbose=True,
                is_python_module=pymod)
        how = "torch JIT loader, ninja"
        so = os.path.join(out, modname + ".so")
    write_json(stamp_path, dict(want, so=so, how=how, built=now()))
    print(f"{a.what}: built {so}")
    return 0


def load_twell(ref, build_dir):
    """Returns (the built inference extension, the reference's twell.py)."""
    import importlib.util

    __import__("torch")  # the extension needs libtorch loaded first

    stamp = read_json(os.path.join(build_dir, "twell", "stamp.json"), {})
    if not stamp.get("so"):
        raise RuntimeError(f"the twell extension is not built (no {build_dir}/twell/stamp.json)")
    spec = importlib.util.spec_from_file_location(EXTENSIONS["twell"][0], stamp["so"])
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    path = os.path.join(ref, "custom_models", "twell_modules", "twell.py")
    spec = importlib.util.spec_from_file_location("reference_twell_py", path)
    tw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tw)
    return ext, tw


def load_hybrid(build_dir):
    import torch

    stamp = read_json(os.path.join(build_dir, "hybrid", "stamp.json"), {})
    if not stamp.get("so"):
        raise RuntimeError(f"the hybrid extension is not built (no {build_dir}/hybrid/stamp.json)")
    torch.ops.load_library(stamp["so"])
    return torch.ops.sparse_ops.ff_forward_gated


# --------------------------------------------------------------------------
# Inputs: twell's dump (bench ffn -dump-inputs) or the same recipe here

ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
             "I64": "int64", "I32": "int32", "U8": "uint8"}


def safetensors_header(path):
    """Returns (metadata, {name: (dtype, shape, begin, end)}, data offset)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    entries = {k: (v["dtype"], v["shape"], v["data_offsets"][0], v["data_offsets"][1]) for k, v in header.items()}
    return meta, entries, 8 + n


def read_safetensors(path, device):
    import torch

    meta, entries, base = safetensors_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, (dt, shape, b, e) in entries.items():
            if dt not in ST_DTYPES:
                raise ValueError(f"{path}: {name}: dtype {dt} not handled")
            buf = bytearray(e - b)
            f.seek(base + b)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{path}: {name}: file too short")
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(getattr(torch, ST_DTYPES[dt])).reshape(shape).to(device)
    return meta, out


def load_dump(dump, density, device):
    """Loads x, ref_rows and the layer of density from a bench ffn dump."""
    meta, xt = read_safetensors(os.path.join(dump, "x.safetensors"), device)
    layers = sorted(glob.glob(os.path.join(dump, "layer-*.safetensors")))
    pick = None
    for p in layers:
        m, _, _ = safetensors_header(p)
        if abs(float(m.get("density", "nan")) - density) <= 1e-9 * max(1.0, density):
            pick = p
    if pick is None:
        raise RuntimeError(f"{dump}: no layer file of density {density} (found {[os.path.basename(p) for p in layers]})")
    lmeta, lt = read_safetensors(pick, device)
    if "gate" not in lt:
        raise RuntimeError(f"{pick}: no gate: the race needs a gated layer")
    return {"x": xt["x"], "ref_rows": xt["ref_rows"].tolist(), "gate": lt["gate"], "up": lt["up"], "down": lt["down"],
            "source": "twell bench ffn -dump-inputs", "meta": dict(meta, **lmeta)}


def unit_rates(f, density, dist, gen, device):
    """Per-unit firing rates with mean density: all equal (uniform), or 30%
    dead units and log-normal rates (sigma 1.5) scaled so that the mean of
    min(1, rate) is density (skewed): the recipe of twell's package synth."""
    import torch

    if dist == "uniform":
        return torch.full((f,), density, dtype=torch.float64, device=device)
    alive = torch.rand(f, generator=gen, device=device, dtype=torch.float64) >= 0.3
    raw = torch.where(alive, torch.exp(1.5 * torch.randn(f, generator=gen, device=device, dtype=torch.float64)),
                      torch.zeros((), dtype=torch.float64, device=device))
    mean = lambda s: torch.clamp(s * raw, max=1.0).mean().item()  # noqa: E731
    lo, hi = 0.0, 1.0
    while mean(hi) < density:
        hi *= 2
        if hi > 1e12:
            raise ValueError(f"density {density} unreachable with skewed rates")
    for _ in range(100):
        mid = (lo + hi) / 2
        if mean(mid) < density:
            lo = mid
        else:
            hi = mid
    return torch.clamp(hi * raw, max=1.0)


def synth_inputs(m, d, f, density, dist, seed, device, ref_rows=16):
    """The workload of twell's package synth, drawn with torch's generator (the
    same distribution, not the same numbers as twell's): tokens with feature
    0 = 1 and the rest N(0, 1); gate rows of unit norm over features 1..d-1
    with bias Phi^-1(rate) in feature 0; up N(0, 1/d); down N(0, 1/(density f))."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rates = unit_rates(f, density, dist, gen, device)
    gate = torch.randn(f, d, generator=gen, device=device, dtype=torch.float64)
    gate[:, 1:] /= gate[:, 1:].norm(dim=1, keepdim=True)
    p = rates.clamp(1e-300, 1 - 1e-16)
    bias = math.sqrt(2) * torch.special.erfinv(2 * p - 1)
    gate[:, 0] = torch.where(rates <= 0, torch.full_like(rates, -40.0), bias)
    up = torch.randn(f, d, generator=gen, device=device, dtype=torch.float64) / math.sqrt(d)
    down = torch.randn(d, f, generator=gen, device=device, dtype=torch.float64) / math.sqrt(density * f)
    x = torch.randn(m, d, generator=gen, device=device, dtype=torch.float32)
    x[:, 0] = 1
    rows = sorted({0, m - 1} | set(torch.randperm(m, generator=gen, device=device)[: max(0, ref_rows - 2)].tolist()))
    bf = torch.bfloat16
    return {"x": x.to(bf), "ref_rows": rows[:ref_rows], "gate": gate.to(bf), "up": up.to(bf), "down": down.to(bf),
            "source": "synth recipe, torch generator", "meta": {"seed": str(seed), "dist": dist, "density": str(density)}}


def input_batches(x0, seed):
    """x0 and row permutations of it (the same distribution), as many as
    twell's bench ffn rotates: enough for 3x L2, between 2 and 8."""
    import torch

    l2 = l2_bytes()
    xbytes = x0.numel() * x0.element_size()
    n = min(max(2, -(-3 * l2 // xbytes)), 8)
    gen = torch.Generator(device=x0.device)
    gen.manual_seed(seed + 1)
    return [x0] + [x0[torch.randperm(x0.shape[0], generator=gen, device=x0.device)] for _ in range(n - 1)]


def l2_bytes():
    import torch

    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 << 20)


# --------------------------------------------------------------------------
# Timing, twell's way


def time_in_turns(paths, xs, reps, prepare=None, at=None):
    """Median event-timed ms of each path (name -> fn(x)) over reps calls,
    after 3 warm-up calls each; the paths take turns, one call each, and a
    buffer of twice the L2 size is written before every timed call. at(name),
    if given, is told which path runs next (so that a crash names it)."""
    import torch

    flush = torch.empty(2 * l2_bytes(), dtype=torch.uint8, device="cuda")
    for name, fn in paths.items():
        if at:
            at(name)
        for i in range(3):
            if prepare:
                prepare()
            fn(xs[i % len(xs)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = {k: [] for k in paths}
    for i in range(reps):
        for j, (name, fn) in enumerate(paths.items()):
            if at:
                at(name)
            if prepare:
                prepare()
            flush.fill_((i + j) % 256)
            x = xs[i % len(xs)]
            start.record()
            out = fn(x)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end))
            del out
    return {k: summarize(v) for k, v in samples.items()}


def summarize(v):
    s = sorted(v)
    n = len(s)
    med = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    q = lambda p: s[min(n - 1, max(0, round(p * (n - 1))))]  # noqa: E731
    return {"ms": med, "min_ms": s[0], "p10_ms": q(0.1), "p90_ms": q(0.9), "samples_ms": [round(t, 5) for t in v]}


def rel_err(got, want):
    """||got - want|| / ||want|| (Frobenius, any shapes of as many
    elements), in float64."""
    g, w = got.double().reshape(-1), want.double().reshape(-1)
    den = w.norm().item()
    num = (g - w).norm().item()
    return num / den if den else num


class Progress:
    """The child's result file, rewritten at every step, so that the parent
    knows what ran when the child dies."""

    def __init__(self, path, base):
        self.path, self.doc = path, dict(base, stage="setup", current=None, paths={})
        self.save()

    def at(self, stage, current=None):
        self.doc["stage"], self.doc["current"] = stage, current
        self.save()

    def path_result(self, name, **kv):
        self.doc["paths"].setdefault(name, {}).update(kv)
        self.save()

    def save(self):
        write_json(self.path, self.doc)


def fp32_setup():
    """fp32 matmuls in full fp32 (no TF32) for the references."""
    import torch

    torch.set_float32_matmul_precision("highest")


# --------------------------------------------------------------------------
# The inference race (one process)


def child_ffn(a, want_paths, prog):
    import torch
    import torch.nn.functional as F

    fp32_setup()
    dev = torch.device("cuda")
    inp = load_dump(a.inputs, a.density, dev) if a.inputs else synth_inputs(a.m, a.d, a.f, a.density, a.dist, a.seed, dev)
    x0, gate, up, down = inp["x"], inp["gate"], inp["up"], inp["down"]
    m, d = x0.shape
    f = gate.shape[0]
    if (m, d, f) != (a.m, a.d, a.f):
        raise RuntimeError(f"inputs are m={m} d={d} f={f}, not the m={a.m} d={a.d} f={a.f} asked for")
    prog.doc.update(inputs=inp["source"], inputs_meta=inp["meta"], ref_rows=len(inp["ref_rows"]))

    # References: float64 on twell's rows; fp32 on all rows, with the gate's
    # statistics (active units per token, per (token, tile) counts).
    rows = torch.tensor(inp["ref_rows"], device=dev)
    xr = x0[rows].double()
    want64 = (F.relu(xr @ gate.double().t()) * (xr @ up.double().t())) @ down.double().t()
    want32 = torch.empty(m, d, dtype=torch.float32, device=dev)
    g32, u32, d32 = gate.float(), up.float(), down.float()
    nnz, max_tile, over_tiles = 0, 0, 0
    for i in range(0, m, 8192):
        xc = x0[i:i + 8192].float()
        g = xc @ g32.t()
        want32[i:i + 8192] = (F.relu(g) * (xc @ u32.t())) @ d32.t()
        if f % D2T_TILE == 0:
            cnt = (g > 0).view(g.shape[0], f // D2T_TILE, D2T_TILE).sum(-1)
            nnz += int(cnt.sum().item())
            max_tile = max(max_tile, int(cnt.max().item()))
            over_tiles += int((cnt > D2T_SLOTS).sum().item())
    del g32, u32, d32
    prog.doc.update(nnz_mean=nnz / m, max_tile_nnz=max_tile, overflow_tiles=over_tiles)

    paths = {}
    for name in want_paths:
        prog.at("setup", name)
        if name == "torch_dense":
            paths[name] = lambda x: F.linear(F.relu(F.linear(x, gate)) * F.linear(x, up), down)
        elif name == "reference_twell":
            ext, tw = load_twell(a.ref, a.build_dir)
            mlp = tw.TwELLGatedMLP(0, gate, up, down.t().contiguous(), ext=ext)
            paths[name] = mlp
        elif name == "reference_d2t":
            # The reference's D2T alone (gate GEMM, ReLU and packing), as
            # twell's d2t_ms times its own: where the two MLPs' time goes.
            ext, tw = load_twell(a.ref, a.build_dir)
            paths[name] = tw.D2TLinear(1, gate, 8, ext=ext)
        else:
            raise RuntimeError(f"unknown path {name}")
    with torch.inference_mode():
        for name, fn in paths.items():
            prog.at("check", name)
            y = fn(x0)
            torch.cuda.synchronize()
            if name == "reference_d2t":
                # Packed words: per 256-column tile a count word, then the
                # entries. The counts should match the fp32 gate's but where
                # the GEMM's summation order flips a value near zero.
                counts = y.view(torch.int32).view(m, f // D2T_TILE, D2T_TILE // 8)[:, :, 0]
                got = int(counts.long().sum().item()) / m
                prog.path_result(name, nnz_mean=got, nnz_mean_fp32=nnz / m,
                                 nnz_rel_diff=abs(got - nnz / m) / max(nnz / m, 1e-9))
            else:
                prog.path_result(name, finite=bool(torch.isfinite(y).all().item()),
                                 rel_err=rel_err(y[rows], want64), rel_err_fp32=rel_err(y.float(), want32))
            del y
        del want32
        prog.at("timing", None)
        xs = input_batches(x0, a.seed)
        prog.doc["input_batches"] = len(xs)
        for name, r in time_in_turns(paths, xs, a.reps, at=lambda name: prog.at("timing", name)).items():
            prog.path_result(name, status="ok", **r)
    prog.at("done")


# --------------------------------------------------------------------------
# The training race (one process)


def child_train(a, want_paths, prog):
    import torch
    import torch.nn.functional as F

    fp32_setup()
    dev = torch.device("cuda")
    inp = synth_inputs(a.m, a.d, a.f, a.density, a.dist, a.seed, dev)
    m = a.m
    prog.doc.update(inputs=inp["source"], inputs_meta=inp["meta"], l1_coeff=a.l1_coeff)
    # Training layout: G = Wg, K = Wu ([f, d]), V = Wd^T ([f, d]).
    G = inp["gate"].clone().requires_grad_()
    K = inp["up"].clone().requires_grad_()
    V = inp["down"].t().contiguous().requires_grad_()
    # The op takes X as [batch, sequence, d] (it reads M as size(0) x size(1)):
    # sequences of 2048 tokens, as in the reference's training micro-batch.
    seq = 2048 if m % 2048 == 0 else m
    shape3 = (m // seq, seq, a.d)
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed + 2)
    gout = torch.randn(m, a.d, generator=gen, device=dev).to(torch.bfloat16).reshape(shape3)
    gl1 = torch.tensor(a.l1_coeff, device=dev, dtype=torch.float32)
    x0 = inp["x"]
    xs = [x.reshape(shape3).clone().requires_grad_() for x in input_batches(x0, a.seed)]
    leaves = [G, K, V] + xs
    prog.doc["x_shape"] = list(shape3)

    def prepare():
        for t in leaves:
            t.grad = None

    def dense(X, Gw, Kw, Vw):
        h = F.relu(X @ Gw.t()) * (X @ Kw.t())
        l1 = h.abs().sum(dtype=torch.float32) / (X.numel() // X.shape[-1])
        return h @ Vw, l1

    # fp32 reference: out, l1 and the gradients of <out, gout> + l1_coeff * l1.
    ref = [t.detach().float().requires_grad_() for t in (xs[0], G, K, V)]
    out32, l132 = dense(*ref)
    torch.autograd.backward([out32, l132], [gout.float(), gl1])
    want = {"out": out32.detach(), "dX": ref[0].grad, "dG": ref[1].grad, "dK": ref[2].grad, "dV": ref[3].grad}
    with torch.no_grad():
        act = (x0.float() @ G.detach().float().t()) > 0
        prog.doc.update(nnz_mean=act.sum().item() / m, l1_fp32=l132.item(),
                        max_unit_tokens=int(act.sum(0).max().item()))
        del act
    del out32, l132, ref

    paths = {}
    for name in want_paths:
        prog.at("setup", name)
        if name == "torch_dense_autograd":
            def step(X):
                out, l1 = dense(X, G, K, V)
                torch.autograd.backward([out, l1], [gout, gl1])
                return out, l1
            paths[name] = step
        elif name == "reference_hybrid":
            op = load_hybrid(a.build_dir)

            def step(X, op=op):
                out, l0, l1 = op(X, G, K, V)[:3]
                torch.autograd.backward([out, l1], [gout, gl1])
                return out, l1, l0
            paths[name] = step
        else:
            raise RuntimeError(f"unknown path {name}")
    for name, fn in paths.items():
        prog.at("check", name)
        prepare()
        X = xs[0]
        res = fn(X)
        torch.cuda.synchronize()
        got = {"out": res[0], "dX": X.grad, "dG": G.grad, "dK": K.grad, "dV": V.grad}
        errs = {k: (rel_err(got[k].float(), want[k]) if got[k] is not None else None) for k in want}
        extra = {"l1": float(res[1].item())}
        if len(res) > 2:
            extra["l0"] = float(res[2].item())
        if name == "reference_hybrid":
            try:
                extra["transpose_overflow_rows"] = int(torch.ops.sparse_ops_config.get_last_transpose_overflow_count().item())
            except Exception as e:  # noqa: BLE001 (a figure, not the race)
                extra["transpose_overflow_rows"] = f"unavailable: {e}"
        prog.path_result(name, rel_err=errs, finite=all(bool(torch.isfinite(t).all().item()) for t in got.values() if t is not None), **extra)
        del res, got
    prepare()
    prog.at("timing", None)
    prog.doc["input_batches"] = len(xs)
    for name, r in time_in_turns(paths, xs, a.reps, prepare=prepare, at=lambda name: prog.at("timing", name)).items():
        prog.path_result(name, status="ok", **r)
    prog.at("done")


def cmd_child(a):
    import torch

    want_paths = a.paths.split(",")
    prog = Progress(a.result, {"kind": a.kind})
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    prog.doc.update(machine_info(torch))
    torch.manual_seed(a.seed)
    (child_ffn if a.kind == "ffn" else child_train)(a, want_paths, prog)
    return 0


# --------------------------------------------------------------------------
# The parent: one child per attempt, crashes recorded


def shape_key(kind, m, density, dist):
    return f"{kind}-m{m}-{dist}-{density:g}"


def describe_exit(rc):
    if rc is None:
        return "timeout", "timed out"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return "crash", name
    return "error", f"exit {rc}"


def tail(path, n=15):
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip() for line in f.readlines()[-n:]]
    except OSError:
        return []


def cmd_measure(a, kind):
    check_ref(a.ref)
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    logs = a.logs or os.path.dirname(os.path.abspath(a.out))
    key = shape_key(kind, a.m, a.density, a.dist)
    entry = {"key": key, "kind": kind, "m": a.m, "d": a.d, "f": a.f, "density": a.density, "dist": a.dist,
             "compression": 8, "reps": a.reps, "seed": a.seed, "date": now(), "attempts": [], "paths": {}}
    remaining = list(PATHS[kind])
    base = BASELINE[kind]
    attempt = 0
    while remaining:
        attempt += 1
        log = os.path.join(logs, f"{key}-{attempt}.log")
        fd, resf = tempfile.mkstemp(prefix="race-child-", suffix=".json")
        os.close(fd)
        cmd = [sys.executable, os.path.abspath(__file__), "_child", kind, "--paths", ",".join(remaining),
               "--result", resf] + child_args(a)
        say(f"{key}: timing {', '.join(remaining)} (attempt {attempt}, log {log})")
        t0 = time.time()
        with open(log, "w") as lf:
            try:
                rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=a.child_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        doc = read_json(resf, {}) or {}
        os.remove(resf)
        for k, v in doc.items():
            if k not in ("paths", "stage", "current", "kind"):
                entry.setdefault(k, v)
        done = {p: r for p, r in doc.get("paths", {}).items() if r.get("status") == "ok"}
        entry["paths"].update(done)
        entry["attempts"].append({"paths": list(remaining), "exit": rc, "stage": doc.get("stage"),
                                  "current": doc.get("current"), "seconds": round(time.time() - t0, 1),
                                  "log": os.path.basename(log)})
        if rc == 0 and doc.get("stage") == "done":
            break
        status, what = describe_exit(rc)
        stage, cur = doc.get("stage"), doc.get("current")
        if cur in remaining:
            culprits = [cur]
        elif stage in ("check", "timing", "done"):
            # Not pinned to a path: blame the reference, keep the baseline.
            culprits = [p for p in remaining if p != base] or list(remaining)
        else:
            culprits = list(remaining)  # the inputs or the process itself failed
        for p in culprits:
            r = dict(doc.get("paths", {}).get(p, {}))
            r.update(status=status, exit=what, stage=stage, log=os.path.basename(log), log_tail=tail(log))
            entry["paths"][p] = r
        say(f"{key}: {status} ({what}) at {stage}" + (f" in {cur}" if cur else "") + f"; recorded for {', '.join(culprits)}")
        remaining = [p for p in remaining if p not in culprits and p not in done]
    entry["reference"] = reference_info(a.ref)
    doc = read_json(a.out, None) or {"schema": REFERENCE_SCHEMA, "ffn": [], "train": []}
    if doc.get("schema") != REFERENCE_SCHEMA:
        sys.exit(f"race_reference: {a.out} is not a {REFERENCE_SCHEMA} file")
    doc.update({k: entry[k] for k in MACHINE_KEYS if k in entry}, reference=entry["reference"], date=entry["date"])
    lst = doc.setdefault(kind, [])
    lst[:] = [e for e in lst if e.get("key") != key] + [entry]
    write_json(a.out, doc)
    print_table(doc)
    return 0


def child_args(a):
    args = ["--ref", a.ref, "--build-dir", a.build_dir, "--m", str(a.m), "--d", str(a.d), "--f", str(a.f),
            "--density", repr(a.density), "--dist", a.dist, "--seed", str(a.seed), "--reps", str(a.reps)]
    if getattr(a, "inputs", None):
        args += ["--inputs", a.inputs]
    if getattr(a, "l1_coeff", None) is not None:
        args += ["--l1-coeff", repr(a.l1_coeff)]
    return args


MACHINE_KEYS = ("python", "torch", "torch_cuda", "gpu", "sms", "l2_bytes", "gpu_memory_bytes", "driver")


def machine_info(torch):
    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, l2_bytes=l2_bytes(),
                    gpu_memory_bytes=p.total_memory)
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            info["driver"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return info


def fmt_ms(r):
    if not r:
        return "-"
    if r.get("status") == "ok":
        return f"{r['ms']:.3f} ms"
    return f"{r.get('status')} ({r.get('exit')})"


def print_table(doc):
    """Every shape of doc so far, one line each, a column per path."""
    for kind in ("ffn", "train"):
        if not doc.get(kind):
            continue
        print(f"{'shape':32}" + "".join(f" {p:>22}" for p in PATHS[kind]))
        for e in doc[kind]:
            print(f"{e['key']:32}" + "".join(f" {fmt_ms(e['paths'].get(p)):>22}" for p in PATHS[kind]), flush=True)


# --------------------------------------------------------------------------
# report: merge with twell's JSON, write race.json and race.md


def pct(d):
    return f"{100 * d:g}%"


def num(v, f="{:.3f}"):
    return f.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def ratio_cell(tw, ref):
    if not (isinstance(tw, (int, float)) and isinstance(ref, (int, float)) and ref > 0):
        return None, "-"
    r = tw / ref
    return r, f"{r:.2f} ({'slower' if r > 1 else 'faster'})"


def ref_cell(r):
    if not r:
        return None, "not run"
    if r.get("status") == "ok":
        return r["ms"], f"{r['ms']:.3f}"
    return None, f"{r.get('status')} ({r.get('exit')})"


def twell_rows(outdir, kind):
    """twell's JSON rows under outdir/twell-KIND-*.json, by (m, density, dist)."""
    rows = {}
    for p in sorted(glob.glob(os.path.join(outdir, f"twell-{kind}-*.json"))):
        doc = read_json(p)
        if doc is None:
            rows.setdefault(("unreadable", p), {"file": os.path.basename(p), "status": "unreadable"})
            continue
        for r in doc if isinstance(doc, list) else [doc]:
            if not isinstance(r, dict):
                continue
            k = (int(r.get("m", 0)), round(float(r.get("density", 0)), 12), r.get("dist", "uniform"))
            rows[k] = dict(r, file=os.path.basename(p))
    return rows


def twell_switches(rows):
    """The TWELL_ settings twell's rows ran under ("switches" in its JSON):
    one "NAME=VALUE" list if every row agrees, else "mixed"; [] for the
    defaults."""
    seen = {tuple(sorted(f"{k}={v}" for k, v in (r.get("switches") or {}).items())) for r in rows if "m" in r}
    if len(seen) > 1:
        return "mixed"
    return list(seen.pop()) if seen else []


def first_float(r, keys):
    for k in keys:
        v = r.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return v
    return None


def cmd_report(a):
    out = a.outdir
    refdoc = read_json(os.path.join(out, "reference.json"), None) or {"ffn": [], "train": []}
    tw_ffn, tw_train = twell_rows(out, "ffn"), twell_rows(out, "train")
    race = {"schema": RACE_SCHEMA, "date": now(),
            "machine": {k: refdoc.get(k) for k in ("gpu", "sms", "l2_bytes", "driver", "torch", "torch_cuda", "python")},
            "reference": refdoc.get("reference"),
            "method": "paths in turns within one process per side, a buffer of twice the L2 written before every "
                      "timed call, CUDA events, 3 warm-up calls, median of the repetitions; twell's side is "
                      "`twell bench ffn -device cuda` on the same inputs (-dump-inputs)",
            "command": a.command or None, "twell_switches": twell_switches(list(tw_ffn.values()) + list(tw_train.values())),
            "ffn": [], "train": []}
    seen = set()
    for e in refdoc.get("ffn", []):
        k = (e["m"], round(e["density"], 12), e["dist"])
        seen.add(k)
        tw = tw_ffn.get(k, {})
        ref_ms, _ = ref_cell(e["paths"].get("reference_twell"))
        ratio, _ = ratio_cell(tw.get("twell_ms"), ref_ms)
        race["ffn"].append({
            "m": e["m"], "density": e["density"], "dist": e["dist"], "d": e["d"], "f": e["f"],
            "torch_dense_ms": (e["paths"].get("torch_dense") or {}).get("ms"),
            "reference_ms": ref_ms,
            "reference_status": (e["paths"].get("reference_twell") or {}).get("status", "not run"),
            "reference_rel_err": (e["paths"].get("reference_twell") or {}).get("rel_err"),
            "reference_rel_err_fp32": (e["paths"].get("reference_twell") or {}).get("rel_err_fp32"),
            "reference_d2t_ms": (e["paths"].get("reference_d2t") or {}).get("ms"),
            "reference_d2t_nnz_mean": (e["paths"].get("reference_d2t") or {}).get("nnz_mean"),
            "twell_d2t_ms": tw.get("d2t_ms"),
            "twell_dense_ms": tw.get("dense_ms"), "twell_ms": tw.get("twell_ms"), "twell_auto_ms": tw.get("auto_ms"),
            "twell_auto_path": tw.get("auto_path"), "twell_auto_calls": tw.get("auto_calls"),
            "twell_rel_err": tw.get("rel_err"),
            "twell_over_reference": ratio, "nnz_mean": e.get("nnz_mean"), "twell_nnz_mean": tw.get("nnz_mean"),
            "inputs": e.get("inputs"), "reference_run": e, "twell_run": tw or None,
        })
    for k, tw in tw_ffn.items():
        if k not in seen:
            race["ffn"].append({"m": k[0], "density": k[1], "dist": k[2], "twell_ms": tw.get("twell_ms"),
                                "twell_dense_ms": tw.get("dense_ms"), "reference_status": "not run", "twell_run": tw})
    seen = set()
    for e in refdoc.get("train", []):
        k = (e["m"], round(e["density"], 12), e["dist"])
        seen.add(k)
        tw = tw_train.get(k, {})
        ref_ms, _ = ref_cell(e["paths"].get("reference_hybrid"))
        dense_ms = (e["paths"].get("torch_dense_autograd") or {}).get("ms")
        tw_ms = first_float(tw, ("twell_ms", "sparse_ms", "step_ms", "ms"))
        race["train"].append({
            "m": e["m"], "density": e["density"], "dist": e["dist"], "d": e["d"], "f": e["f"],
            "torch_dense_ms": dense_ms, "reference_ms": ref_ms,
            "reference_status": (e["paths"].get("reference_hybrid") or {}).get("status", "not run"),
            "reference_speedup_vs_torch": dense_ms / ref_ms if dense_ms and ref_ms else None,
            "reference_rel_err": (e["paths"].get("reference_hybrid") or {}).get("rel_err"),
            "twell_ms": tw_ms, "twell_status": tw.get("status", "ok" if tw_ms else "not run"),
            "twell_over_reference": ratio_cell(tw_ms, ref_ms)[0],
            "reference_run": e, "twell_run": tw or None,
        })
    for k, tw in tw_train.items():
        if k not in seen:
            race["train"].append({"m": k[0], "density": k[1], "dist": k[2], "twell_status": tw.get("status", "ok"),
                                  "twell_ms": first_float(tw, ("twell_ms", "sparse_ms", "step_ms", "ms")),
                                  "reference_status": "not run", "twell_run": tw})
    write_json(os.path.join(out, "race.json"), race)
    md = render_md(race)
    with open(os.path.join(out, "race.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def render_md(race):
    mc, ref = race["machine"], race.get("reference") or {}
    L = ["# twell against the reference TwELL kernels", ""]
    L.append(f"{race['date']}; {mc.get('gpu') or 'GPU unknown'} ({mc.get('sms') or '?'} SMs, "
             f"{(mc.get('l2_bytes') or 0) >> 20} MiB L2, driver {mc.get('driver') or '?'}); "
             f"PyTorch {mc.get('torch') or '?'} (CUDA {mc.get('torch_cuda') or '?'}); reference commit "
             f"{ref.get('commit', 'unknown')}.")
    if race.get("command"):
        L.append(f"Command: `{race['command']}`.")
    sw = race.get("twell_switches")
    if sw == "mixed":
        L.append("twell's settings: mixed (see each row's `switches` in race.json).")
    elif sw is not None:
        L.append("twell's settings: " + (", ".join(f"`{x}`" for x in sw) if sw else "the defaults") + ".")
    L.append("Method: " + race["method"] + ". Compare ratios within this run only.")
    dims = sorted({(r.get("d"), r.get("f")) for r in race["ffn"] + race["train"] if r.get("d")})
    dims = ", ".join(f"d {d}, f {f}" for d, f in dims) or "d ?, f ?"
    L += ["", f"## MLP block (inference), {dims}, C 8, bf16", ""]
    L.append("| m | density | dist | twell dense ms | PyTorch dense ms | reference TwELL ms | twell TwELL ms "
             "| twell auto ms | twell / reference | D2T ms reference / twell | rel err reference / twell |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in race["ffn"]:
        ref_txt = ref_cell((r.get("reference_run") or {}).get("paths", {}).get("reference_twell"))[1]
        L.append(f"| {r['m']} | {pct(r['density'])} | {r['dist']} | {num(r.get('twell_dense_ms'))} "
                 f"| {num(r.get('torch_dense_ms'))} | {ref_txt} | {num(r.get('twell_ms'))} "
                 f"| {num(r.get('twell_auto_ms'))} | {ratio_cell(r.get('twell_ms'), r.get('reference_ms'))[1]} "
                 f"| {num(r.get('reference_d2t_ms'))} / {num(r.get('twell_d2t_ms'))} "
                 f"| {num(r.get('reference_rel_err'), '{:.1e}')} / {num(r.get('twell_rel_err'), '{:.1e}')} |")
    L += ["", "## MLP block (training), forward + backward with the L1 term", ""]
    L.append("| m | density | dist | PyTorch dense autograd ms | reference hybrid ms | reference speedup "
             "| twell ms | twell / reference | reference max rel err (out, dX, dG, dK, dV) |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for r in race["train"]:
        ref_txt = ref_cell((r.get("reference_run") or {}).get("paths", {}).get("reference_hybrid"))[1]
        errs = r.get("reference_rel_err")
        errs = errs.values() if isinstance(errs, dict) else [errs]
        vals = [v for v in errs if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tw_txt = num(r.get("twell_ms")) if r.get("twell_ms") is not None else r.get("twell_status", "not run")
        sp = r.get("reference_speedup_vs_torch")
        L.append(f"| {r['m']} | {pct(r['density'])} | {r['dist']} | {num(r.get('torch_dense_ms'))} | {ref_txt} "
                 f"| {num(sp, '{:.2f}x')} | {tw_txt} | {ratio_cell(r.get('twell_ms'), r.get('reference_ms'))[1]} "
                 f"| {num(max(vals) if vals else None, '{:.1e}')} |")
    L += ["", "twell / reference: twell's TwELL time over the reference's (below 1: twell is faster). "
          "rel err: ||y - y_ref|| / ||y_ref|| against a float64 reference on the token rows twell checks. "
          "Every figure, with the samples and the fp32 errors over all rows, is in race.json.", ""]
    return "\n".join(L)


# --------------------------------------------------------------------------


def density_arg(s):
    s = s.strip()
    v = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"density {s} must be inside (0, 1)")
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{build,ffn,train,report}")

    b = sub.add_parser("build", help="build the reference's extensions (cached by a stamp)")
    b.add_argument("--ref", required=True)
    b.add_argument("--build-dir", required=True)
    b.add_argument("--only", choices=["both", "twell", "hybrid"], default="both")

    b1 = sub.add_parser("_build_one")
    b1.add_argument("what", choices=list(EXTENSIONS))
    b1.add_argument("--ref", required=True)
    b1.add_argument("--build-dir", required=True)

    def shape_args(p, inputs):
        p.add_argument("--ref", required=True)
        p.add_argument("--build-dir", required=True)
        p.add_argument("--m", type=int, required=True)
        p.add_argument("--d", type=int, default=2048)
        p.add_argument("--f", type=int, default=5632)
        p.add_argument("--density", type=density_arg, required=True)
        p.add_argument("--dist", choices=["uniform", "skewed"], default="uniform")
        p.add_argument("--seed", type=int, default=1)
        p.add_argument("--reps", type=int, default=30)
        if inputs:
            g = p.add_mutually_exclusive_group(required=True)
            g.add_argument("--inputs", help="a folder written by twell bench ffn -dump-inputs")
            g.add_argument("--synth", action="store_true", help="draw the workload here (same recipe, other numbers)")
        else:
            p.add_argument("--l1-coeff", type=float, default=2e-5, help="weight of the L1 term (its gradient)")

    for kind in ("ffn", "train"):
        p = sub.add_parser(kind, help=f"time the {kind} race for one shape")
        shape_args(p, kind == "ffn")
        p.add_argument("--out", required=True, help="the JSON file the figures go to (updated)")
        p.add_argument("--logs", help="folder for the per-attempt logs (default: beside --out)")
        p.add_argument("--child-timeout", type=float, default=900)
    c = sub.add_parser("_child")
    c.add_argument("kind", choices=["ffn", "train"])
    c.add_argument("--paths", required=True)
    c.add_argument("--result", required=True)
    c.add_argument("--inputs")
    c.add_argument("--l1-coeff", type=float, default=2e-5)
    for flag, typ, req in (("--ref", str, True), ("--build-dir", str, True), ("--m", int, True),
                           ("--d", int, False), ("--f", int, False), ("--density", density_arg, True),
                           ("--seed", int, False), ("--reps", int, False)):
        c.add_argument(flag, type=typ, required=req)
    c.add_argument("--dist", choices=["uniform", "skewed"], default="uniform")
    c.set_defaults(d=2048, f=5632, seed=1, reps=30)

    r = sub.add_parser("report", help="merge OUTDIR's JSON files into race.json and race.md")
    r.add_argument("outdir")
    r.add_argument("--command", default="", help="the race's command line, recorded in the report")

    a = ap.parse_args(argv)
    if a.cmd in ("ffn", "train", "_child") and (a.m < 1 or a.reps < 1):
        ap.error("--m and --reps must be positive")
    if a.cmd == "build":
        return cmd_build(a)
    if a.cmd == "_build_one":
        return build_one(a)
    if a.cmd in ("ffn", "train"):
        if a.cmd == "ffn" and a.inputs and not os.path.isfile(os.path.join(a.inputs, "x.safetensors")):
            ap.error(f"--inputs {a.inputs}: no x.safetensors there (write it with twell bench ffn -dump-inputs)")
        return cmd_measure(a, a.cmd)
    if a.cmd == "_child":
        return cmd_child(a)
    if a.cmd == "report":
        if not os.path.isdir(a.outdir):
            ap.error(f"{a.outdir}: no such folder")
        return cmd_report(a)
    return 2


if __name__ == "__main__":
    sys.exit(main())
