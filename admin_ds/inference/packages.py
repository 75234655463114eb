"""A compiled decoder step's graphs kept on disk, loaded by later processes without compiling
(translate.py --compiled-dir).

torch.compile's float32 graphs of a ``CompiledDecoderStep`` hold oneDNN's packed weights, which
inductor's cache on disk does not keep: every process compiled them again, for minutes
(BENCHMARKS.md, "What --compile costs at the start of a process"). Here each graph is exported
(``torch.export``) for one kind of call, its sizes symbolic, and compiled ahead of time by
AOTInductor into a package (a shared library with the packed weights in it) written once into a
directory; a later process loads it in a fraction of a second. Calls the packages do not cover (an
int8 model, a size outside a kind's ranges, a graph export cannot take) run torch.compile's graphs
as before. Every package checks its inputs' dtypes and sizes against what it was compiled for
before it computes (AOTInductor's runtime checks, switched on here), so a call it does not fit
falls back instead of reading memory wrongly.

Kinds, each a package of its own, built the first time a call needs it:

- a decoder step: few rows (up to ``CompiledDecoderStep.template_rows``; generated product
  kernels), some (up to ``few_rows``; each product the faster of the two, timed at ``few_rows``
  rows when the package is built) or many (ATen's products); the first position (nothing cached)
  or a later one; the rows per sentence (beams, 1 for greedy and sampling); and whether the caches
  are kept in place (beam search);
- the encoder with every decoder layer's encoder keys and values: few real source tokens
  (``few_tokens``) or many;
- a search's tensor code between two steps (beam search's choices where one sentence is left):
  one kind for each set of its constant arguments (beams, flags) and sizes of 0 or 1.

A package is named by a digest of what its code depends on: the model's configuration and every
weight, the source of the step and the model's layers (and of a search's code), the compile
options, torch's version and the CPU (its instruction-set flags and vendor: machines of several
kinds sharing a directory keep their packages apart).
A package is a shared library that the process runs, so the directory must be the user's own and
not writable by others (checked when it is opened, as for any directory of executables).
Processes that need a missing package at once (back-translation's ranks on one machine) take turns
on a lock beside it, removed once the package is in place: one builds it, the others wait and load
it. A package is written under a temporary name and renamed into place, so no process loads a
half-written file; it holds the model's weights and is readable by this user alone (mode 0600).
A package loads into memory its own copy of the weights it uses; the library it was copied from is
removed from $TMPDIR at once and its pages handed back (``_extracted_privately``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import inspect
import json
import logging
import mmap
import os
import platform
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from admin_ds.model import layers, residual, transformer
from admin_ds.inference import packed, step as step_module

log = logging.getLogger(__name__)

__all__ = ["GraphPackages", "build_seconds", "open_packages"]

_BUILD_SECONDS = [0.0]  # every GraphPackages' builds in this process


def build_seconds() -> float:
    """Seconds this process has spent building packages (step.compilation_seconds counts them)."""
    return _BUILD_SECONDS[0]


class _Exported(nn.Module):
    """What torch.export traces: ``fn`` over the weights of ``modules`` (the model and the stacked
    encoder product), which become the package's constants."""

    def __init__(self, fn: Callable, *modules: nn.Module) -> None:
        super().__init__()
        self.fn, self.modules_used = fn, nn.ModuleList(modules)

    def forward(self, *args):
        return self.fn(*args)


class GraphPackages:
    """The AOTInductor packages of one ``CompiledDecoderStep`` in ``directory``: ``decoder`` and
    ``encoder`` run a call through its kind's package (loaded, or built and written first), or
    return None where no package covers it."""

    def __init__(self, step: "step_module.CompiledDecoderStep", directory: Path) -> None:
        self.step, self.directory = step, directory
        self.key = _digest(step)
        self._loaded: dict[str, Optional[Callable]] = {}  # kind -> package, or None: not packaged
        self._filled = torch.empty(0, 0)  # a size-only argument: (positions filled, 0)
        self._search_kinds: dict[tuple, str] = {}  # (fn, its arguments' pattern) -> kind
        self.built: list[str] = []  # kinds this process built (the others it loaded)
        self.build_seconds = 0.0
        self.load_seconds = 0.0

    @property
    def loaded(self) -> list[str]:
        """The kinds this process runs from packages, built or loaded."""
        return [kind for kind, package in self._loaded.items() if package is not None]

    @property
    def built_bytes(self) -> int:
        """What the kinds this process built take on disk."""
        return sum(self.path(kind).stat().st_size for kind in self.built)

    def path(self, kind: str) -> Path:
        return self.directory / f"{self.key[:32]}-{kind}.pt2"

    def decoder(self, tokens: torch.Tensor, caches, mask: torch.Tensor) -> Optional[torch.Tensor]:
        """The step's logits from its kind's package, or None."""
        step = self.step
        rows, sentences = tokens.size(0), caches.encoder_keys.size(1)
        per, left = divmod(rows, sentences)
        in_place = caches.origins is not None
        if left or mask is None or mask.size(2) < 2 or not all(t.is_contiguous() for t in (*caches.keys, *caches.values)):
            return None
        first = caches.length == 0
        # Up to template_rows rows the products are the generated kernels, chosen without a
        # benchmark; up to few_rows, each product is timed at few_rows rows against ATen's; above,
        # ATen's (as CompiledDecoderStep's graphs choose). One package for 1-16 rows, exported at 2,
        # took the generated kernels for all of them: greedy decoding with a base-size model 16
        # sentences at a time ran at 0.81x ATen's speed (BENCHMARKS.md).
        tier = "few" if rows <= step.template_rows else "some" if rows <= step.few_rows else "many"
        # One buffer row holds every position (one sentence, one hypothesis): the step attends
        # without gathering (CompiledDecoderStep._attend), a graph of its own with one row.
        single = in_place and caches.keys[0].size(0) == 1
        kind = (f"step-{tier}-{'first' if first else 'later'}-per{per}"
                f"{'-in-place' if in_place else ''}{'-one-row' if single else ''}")
        package = self._package(
            kind, lambda: self._export_decoder(tokens, caches, mask, tier, first, per, in_place, single),
            templates_first=tier == "few", max_autotune=tier != "many")
        if package is None:
            return None
        if self._filled.size(0) < caches.length:
            self._filled = torch.empty(max(2 * self._filled.size(0), caches.length), 0)
        filled = self._filled.narrow(0, 0, caches.length)
        # A package reads its tensors with the strides of the example it was exported from (unlike
        # torch.compile's graphs, whose guards check them): contiguous. The mask of one sentence is
        # an expanded view, copied here; the caches, which the step writes into, are contiguous.
        return self._run(kind, package, tokens, caches.keys, caches.values, caches.encoder_keys.contiguous(),
                         caches.encoder_values.contiguous(), filled, _contiguous(caches.origins), mask.contiguous())

    def encoder(self, src_tokens: torch.Tensor, src_pad: torch.Tensor, index: torch.Tensor):
        """(enc, encoder keys, encoder values) from the encoder's package, or None."""
        if src_tokens.size(1) < 2:
            return None
        few = index.size(0) <= self.step.few_tokens
        kind = f"encoder-{'few' if few else 'many'}"
        package = self._package(kind, lambda: self._export_encoder(src_tokens, src_pad, index, few),
                                templates_first=False, max_autotune=few)
        if package is None:
            return None
        return self._run(kind, package, src_tokens.contiguous(), src_pad.contiguous(), index.contiguous())

    def search(self, fn: Callable, args: tuple) -> Optional[tuple]:
        """``fn(*args)`` from a package, or None: a search's tensor code between two steps
        (``step.compiled``; beam search's choices), which holds no weights. Its other arguments
        (beams, special tokens, flags; None for an absent tensor) are constants of the package, and
        so are its tensors' sizes of 0 and 1 (export makes them so); both are part of the kind.
        The other sizes are symbolic wherever the code allows (``Dim.AUTO``)."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        pattern = tuple((a.dtype, tuple(min(n, 2) for n in a.shape)) if isinstance(a, torch.Tensor) else a
                        for a in args)
        kind = self._search_kinds.get((fn, pattern))
        if kind is None:
            if not all(isinstance(a, (torch.Tensor, bool, int, float, type(None))) for a in args):
                return None
            code = inspect.getsource(sys.modules[fn.__module__])  # the digest covers the step's code, not fn's
            h = hashlib.sha256(repr((fn.__qualname__, pattern, code)).encode()).hexdigest()
            kind = self._search_kinds[(fn, pattern)] = f"search-{fn.__name__.strip('_')}-{h[:16]}"
        package = self._package(kind, lambda: self._export_search(fn, args), templates_first=False, max_autotune=False)
        return None if package is None else self._run(kind, package, *(t.contiguous() for t in tensors))

    def _run(self, kind: str, package: Callable, *args):
        """``package(*args)``, or None where the package fails: it checks every input's dtype,
        sizes and fixed strides against what it was compiled for (AOTI_RUNTIME_CHECK_INPUTS, set
        when the first package loads) before it computes anything, and prints what it refused. The
        kind then runs through torch.compile's graphs in this process."""
        try:
            return package(*args)
        except RuntimeError as e:
            log.warning("the compiled %s graph on disk failed (%s; its reason is printed above); it is compiled "
                        "in this process", kind, str(e).strip().splitlines()[0])
            self._loaded[kind] = None
            return None

    def _package(self, kind: str, export: Callable, templates_first: bool, max_autotune: bool) -> Optional[Callable]:
        if kind in self._loaded:
            return self._loaded[kind]
        path, package = self.path(kind), None
        if (seen := _file_identity(path)) is not None:
            package = self._load(path)
        if package is None:
            with _building(path, kind):  # another process may have built it while this one waited
                if _file_identity(path) not in (None, seen):
                    package = self._load(path)
                if package is None:
                    package = self._build(kind, path, export, templates_first, max_autotune)
        self._loaded[kind] = package
        return package

    def _load(self, path: Path) -> Optional[Callable]:
        # Read once by each package's library, at its first call: a package then refuses inputs
        # of sizes or dtypes it was not compiled for instead of reading them wrongly (~1 us a tensor).
        os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
        start = time.perf_counter()
        try:
            with _extracted_privately():
                package = torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # a package from an interrupted or other build: built again
            log.warning("compiled graph %s could not be loaded (%s); building it again", path, e)
            return None
        self.load_seconds += time.perf_counter() - start
        return package

    def _build(self, kind: str, path: Path, export: Callable, templates_first: bool,
               max_autotune: bool) -> Optional[Callable]:
        import torch._inductor

        log.info("compiling the %s graph into %s (once for this model on this machine)", kind, path)
        start = time.perf_counter()
        options = dict(step_module.COMPILE_OPTIONS)
        options["max_autotune"] = options["max_autotune"] and max_autotune
        options.pop("freezing")  # set by compile_settings
        # The input checks (_run) hold a symbolic size to the range the graph was traced for, whose
        # lower bound is 2 whatever Dim's min (export traces sizes of 1 as if they were larger). The
        # step's and encoder's graphs are exported for sizes from 1 on (one sentence, one position
        # filled), which the tests check against the flat step; a search's kinds keep sizes of 1 apart.
        options["aot_inductor.check_lowerbound"] = False
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp.pt2")  # AOTInductor wants .pt2
        try:
            with torch.no_grad(), step_module.compile_settings(templates_first):
                program = export()
                torch._inductor.aoti_compile_and_package(program, package_path=str(temporary),
                                                         inductor_configs=options)
            temporary.chmod(0o600)  # the model's weights are in it: for this user alone, as its directory
            os.replace(temporary, path)
        except Exception as e:  # torch.export or AOTInductor cannot take this graph: torch.compile's run it
            log.warning("the %s graph cannot be kept on disk (%s: %s); it is compiled in this process",
                        kind, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            log.debug("%s", e)
            temporary.unlink(missing_ok=True)
            return None
        seconds = time.perf_counter() - start
        size = path.stat().st_size
        log.info("compiled the %s graph in %.0f s: %s, %.1f MB", kind, seconds, path, size / 1e6)
        self.build_seconds += seconds
        _BUILD_SECONDS[0] += seconds
        self.built.append(kind)
        return self._load(path)

    # torch.export traces an example of each kind, made here with sizes of 2 and more: a size of 1
    # in the example would become a constant of the package (as torch.compile makes it one). Tokens:
    # any but padding.
    def _export_decoder(self, tokens, caches, mask, tier: str, first: bool, per: int, in_place: bool,
                        single: bool):
        from torch.export import Dim

        step, most = self.step, self.step.model.cfg.max_positions
        # The tier's sentences (rows / per), and the example's: 2 for few (the least that stays
        # symbolic), the most for some (where the products are timed), the least for many.
        low, top = {"few": (1, step.template_rows // per), "some": (step.template_rows // per + 1, step.few_rows // per),
                    "many": (step.few_rows // per + 1, None)}[tier]
        b = 1 if single else min(2, top) if tier == "few" else top if tier == "some" else low
        n = 0 if first else 2
        # Caches kept in place have a row for every hypothesis the batch began with; others, one a row.
        rows, buffer_rows, positions, source = per * b, per * b + (in_place and not single), n + step.room + 1, 5
        keys, encoder_keys = caches.keys[0], caches.encoder_keys
        layers, _, heads, head_dim, _ = encoder_keys.shape  # (L, b, H, Dh, S)
        cache = keys.new_zeros(buffer_rows, heads, positions, head_dim)
        example = (tokens.new_full((rows,), step.model.pad_idx + 1), [cache.clone() for _ in caches.keys],
                   [cache.clone() for _ in caches.values], encoder_keys.new_zeros(layers, b, heads, head_dim, source),
                   encoder_keys.new_zeros(layers, b, heads, source, head_dim), torch.empty(n, 0),
                   caches.origins.new_zeros(rows, positions) if in_place else None,
                   mask.new_zeros(heads * b, 1, source))

        sentences_dim = Dim.STATIC if single or top == low else Dim("sentences", min=low, max=top)
        rows_dim = sentences_dim if per == 1 or sentences_dim is Dim.STATIC else per * sentences_dim
        buffers_dim = (Dim.STATIC if single else rows_dim if not in_place
                       else Dim("buffer_rows", min=max(2, per * low)))
        buffers = {0: buffers_dim, 2: Dim("positions", min=step.room + (0 if first else 1))}
        source_dim = Dim("source", min=2, max=most)
        dynamic = ({0: rows_dim}, [buffers] * len(caches.keys), [buffers] * len(caches.values),
                   {1: sentences_dim, 4: source_dim}, {1: sentences_dim, 3: source_dim},
                   None if first else {0: Dim("filled", min=1, max=most - 1)},
                   {0: rows_dim, 1: Dim("origin_positions", min=step.room + (0 if first else 1))} if in_place else None,
                   {0: Dim.STATIC if sentences_dim is Dim.STATIC else heads * sentences_dim, 2: source_dim})

        def decoder(tokens, keys, values, encoder_keys, encoder_values, filled, origins, mask):
            return step._decoder_of(tokens, keys, values, encoder_keys, encoder_values, filled.size(0), origins, mask)

        return torch.export.export(_Exported(decoder, step.model, step.encoder_kv), example,
                                   dynamic_shapes={"args": dynamic}, strict=False)

    def _export_encoder(self, src_tokens, src_pad, index, few: bool):
        from torch.export import Dim

        step = self.step
        b, s = (2, 5) if few else (3, step.few_tokens)  # every position real: b * s tokens
        example = (src_tokens.new_full((b, s), step.model.pad_idx + 1), src_pad.new_zeros(b, s), torch.arange(b * s))
        sentences, length = Dim("sentences", min=1), Dim("source", min=2, max=step.model.cfg.max_positions)
        tokens = Dim("tokens", min=1, max=step.few_tokens) if few else Dim("tokens", min=step.few_tokens + 1)
        dynamic = ({0: sentences, 1: length}, {0: sentences, 1: length}, {0: tokens})
        return torch.export.export(_Exported(step._encoder, step.model, step.encoder_kv), example,
                                   dynamic_shapes={"args": dynamic}, strict=False)

    def _export_search(self, fn: Callable, args: tuple):
        from torch.export import Dim

        tensors = tuple(a.contiguous() for a in args if isinstance(a, torch.Tensor))

        def call(*given):
            given = iter(given)
            return fn(*(next(given) if isinstance(a, torch.Tensor) else a for a in args))

        dynamic = tuple({d: Dim.AUTO for d, n in enumerate(t.shape) if n >= 2} for t in tensors)
        return torch.export.export(_Exported(call), tensors, dynamic_shapes={"args": dynamic}, strict=False)


def open_packages(step: "step_module.CompiledDecoderStep", directory: str | os.PathLike) -> GraphPackages:
    """The packages of ``step`` in ``directory`` (made, for this user alone, where missing). Raises
    ValueError for a directory another user owns or others may write to: its packages would run in
    this process."""
    packages = GraphPackages(step, prepare_directory(directory))
    step.packages = packages
    return packages


def prepare_directory(directory: str | os.PathLike) -> Path:
    """``directory``, made for this user alone where missing, once it is safe to load packages from.
    Raises ValueError, naming it, where it cannot be made or read, is not a directory, or another
    user owns it or others may write to it."""
    directory = Path(directory)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
    except OSError as e:
        raise ValueError(f"compiled graphs directory {directory}: {e.strerror or e}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"compiled graphs directory {directory}: not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ValueError(f"compiled graphs directory {directory}: owned by another user (uid {info.st_uid}); "
                         "its packages would run in this process")
    if info.st_mode & 0o022:
        raise ValueError(f"compiled graphs directory {directory}: writable by others (mode "
                         f"{stat.S_IMODE(info.st_mode):o}); its packages would run in this process")
    return directory


@contextlib.contextmanager
def _building(path: Path, kind: str) -> Iterator[None]:
    """Held while a package is looked for again and built: ranks that start together on one machine
    (back-translation) build each package once, the others wait for it and load it. An exclusive
    flock on a file beside it, released by the kernel if the builder dies. The file is removed once
    the package is in place: a process that finds the package takes no lock."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): each process builds what it finds missing
        yield
        return
    lock = path.with_name(f".{path.stem}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish compiling the %s graph into %s", kind, path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
        if path.exists():
            with contextlib.suppress(OSError):
                lock.unlink()
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _extracted_privately() -> Iterator[None]:
    """Held while a package loads. AOTInductor extracts the package's library into a new directory
    under $TMPDIR and removes it when the process exits normally; a process that is killed (a
    preempted job, the OOM killer) left it there, a package's size each time (a big-size model's
    step: 0.4 GB). Here it goes into a directory of its own, removed once the package is loaded:
    the library stays mapped, and the system frees its space when the process ends, however it
    ends. The library's pages that loading read are handed back first (``_release_pages``)."""
    private = os.path.realpath(tempfile.mkdtemp(prefix="admin_ds_package_"))
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = private  # read by the loader
    try:
        yield
        _release_pages(private)
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(private, ignore_errors=True)


def _release_pages(directory: str) -> int:
    """Advise the system to take back the pages of every file under ``directory`` that this process
    maps read-only; the bytes it took the advice for. Loading a package copies its weights out of
    its library; the pages copied from stayed resident, as much again as the weights (BENCHMARKS.md,
    "A big-size model through the graphs on disk"). MADV_PAGEOUT reclaims clean file pages and
    never discards data (a page the loader wrote is anonymous and stays); the rare page needed
    later is read again from the file, which stays while it is mapped. Linux 5.4 and later; an
    older kernel refuses the advice and keeps the pages, and elsewhere nothing is asked (0)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    prefix, released = directory.rstrip(os.sep) + os.sep, 0
    for line in maps:  # start-end perms offset device inode path
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "w" not in fields[1] and fields[5].startswith(prefix):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if madvise(start, end - start, getattr(mmap, "MADV_PAGEOUT", 21)) == 0:  # EINVAL before 5.4
                released += end - start
    return released


def _file_identity(path: Path) -> Optional[tuple]:
    """Which file is at ``path`` (None: none), to tell a package renamed into place since."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns, info.st_size


def _contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def _cpu_identity() -> list[str]:
    """What a package built on this CPU may rely on: its instruction sets (ATen's choice, and every
    flag /proc/cpuinfo lists, which decide inductor's), oneDNN's limit on them where one is set, and
    its vendor (on which MKL's and oneDNN's code paths, and so their packed weights' layouts,
    depend). A directory in a home shared by machines of several kinds (a cluster's partitions)
    then holds each kind's packages apart: one built on another kind of CPU may use instructions
    this one lacks, or weights packed for code it does not run, and is built again here instead."""
    info = packed._cpuinfo()
    return [torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            info.get("vendor_id", platform.machine()), " ".join(sorted(info.get("flags", "").split()))]


def _digest(step: "step_module.CompiledDecoderStep") -> str:
    """What a package's code depends on, as one sha256: the model's configuration and weights (the
    decoder's and the stacked encoder product's), the source of the code traced, the compile
    options, torch and the CPU (``_cpu_identity``)."""
    h = hashlib.sha256()
    sources = [inspect.getsource(m) for m in (step_module, layers, residual, transformer, sys.modules[__name__])]
    header = {"config": repr(step.model.cfg), "torch": torch.__version__, "python": sys.version_info[:2],
              "cpu": _cpu_identity(), "options": repr(step_module.COMPILE_OPTIONS),
              "sizes": [step.template_rows, step.few_rows, step.few_tokens, step.room],
              "sources": [hashlib.sha256(s.encode()).hexdigest() for s in sources]}
    h.update(json.dumps(header, sort_keys=True, default=str).encode())
    named = [*step.model.state_dict().items(), *(("encoder_kv." + k, v) for k, v in step.encoder_kv.state_dict().items())]
    for name, t in named:
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
