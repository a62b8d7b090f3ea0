"""The compiled-kernel cache on disk: keys, damaged entries, processes sharing it, the off switch; the compile
that fills it, and the worker that compiles ahead into it. (That a kernel loaded from the cache equals a fresh
compile is checked on the GPU, in test_gpu.py.)"""

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from numattn.configs.attention import MmaConfig
from numattn.kernels import kernel_cache, launch
from numattn.kernels.attention_mma import mma_attention_kernel

pytestmark = pytest.mark.sim


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", str(directory))
    return directory


def entry(label="kernel A"):
    return kernel_cache.Entry(label, "_Z6kernel", bytes(range(256)) * 40)


def test_keys_follow_the_specialisation():
    """One key per kernel factory's arguments and argument types: the same call gives the same key, a
    different tile, dtype or flag another (each reaches the kernel through its closures)."""
    def key(*args, argtypes=("array(uint16, 4d, A)",), cc=(9, 0)):
        return kernel_cache.kernel_key(mma_attention_kernel(*args), argtypes, cc)

    base = (MmaConfig(64, 4, 1, True), "float16", 64, 64, True, True)
    assert key(*base) == key(*base)
    variants = [
        (MmaConfig(32, 4, 1, True), *base[1:]),
        (base[0], "bfloat16", *base[2:]),
        (*base[:4], False, True),
        (*base[:5], False),
    ]
    keys = {key(*args) for args in variants}
    assert len(keys) == len(variants) and key(*base) not in keys
    assert key(*base, argtypes=("array(uint16, 4d, C)",)) != key(*base)
    assert key(*base, cc=(8, 0)) != key(*base)


def test_a_kernel_without_a_stable_description_is_not_cached(cache_dir):
    """A closure value whose only description is an address (here a bare ``object()``) gives no key: a
    warning, and the kernel is built in every process rather than risk another kernel's entry."""
    import numpy as np

    def factory(value):
        def kernel():
            return value

        return kernel

    with pytest.warns(kernel_cache.KernelCacheWarning, match="does not cache kernel"):
        key = kernel_cache.kernel_key(factory(object()), (), (9, 0))
    assert key is None
    builds = []
    for _ in range(2):
        kernel_cache.cached_kernel(key, lambda: builds.append(1) or entry())
    assert len(builds) == 2 and not cache_dir.exists()
    # arrays are described by their contents, not by their (elided) repr
    first, second = np.zeros(5000), np.zeros(5000)
    second[2500] = 1
    assert kernel_cache.kernel_key(factory(first), (), (9, 0)) != kernel_cache.kernel_key(factory(second), (), (9, 0))


def test_source_digest_changes_with_any_kernel_source(tmp_path):
    package = tmp_path / "pkg" / "kernels"
    package.mkdir(parents=True)
    (package / "ptx.py").write_text("X = 1\n")
    (package.parent / "_cuda.py").write_text("Y = 2\n")
    before = kernel_cache.source_digest(package)
    (package / "ptx.py").write_text("X = 3\n")
    assert kernel_cache.source_digest.__wrapped__(package) != before
    (package / "ptx.py").write_text("X = 1\n")
    (package.parent / "_cuda.py").write_text("Y = 4\n")
    assert kernel_cache.source_digest.__wrapped__(package) != before
    (package.parent / "_cuda.py").write_text("Y = 2\n")
    (package / "primitives").mkdir()
    (package / "primitives" / "mma.py").write_text("Z = 5\n")  # a subpackage's modules count too
    assert kernel_cache.source_digest.__wrapped__(package) != before


def test_an_entry_is_built_once_then_read(cache_dir):
    builds = []

    def build():
        builds.append(1)
        return entry()

    first = kernel_cache.cached_kernel("k" * 64, build)
    second = kernel_cache.cached_kernel("k" * 64, build)
    assert first == second == entry() and len(builds) == 1
    [(path, label, size)] = kernel_cache.entries()
    assert (path.name, label) == ("k" * 64 + ".kernel", "kernel A") and size > len(entry().cubin)


@pytest.mark.parametrize("damage", ["truncated", "altered", "garbage", "empty"])
def test_a_damaged_entry_is_compiled_again_with_a_warning(cache_dir, damage):
    kernel_cache.cached_kernel("d" * 64, entry)
    path = cache_dir / ("d" * 64 + ".kernel")
    data = path.read_bytes()
    damaged = {"truncated": data[:-100], "altered": data[:-1] + bytes([data[-1] ^ 1]),
               "garbage": b"\x00\xff" * 50, "empty": b""}[damage]
    path.write_bytes(damaged)
    with pytest.warns(kernel_cache.KernelCacheWarning, match="damaged"):
        rebuilt = kernel_cache.cached_kernel("d" * 64, lambda: entry("rebuilt"))
    assert rebuilt.label == "rebuilt"
    assert kernel_cache.read_entry(path) == rebuilt  # replaced by the new build


def test_the_off_switch(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_directory() is None
    builds = []
    for _ in range(2):
        kernel_cache.cached_kernel("o" * 64, lambda: builds.append(1) or entry())
    assert len(builds) == 2 and not any(tmp_path.rglob("*"))


def test_the_default_location_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMATTN_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_directory() == tmp_path / "numattn" / "kernels"


def test_an_unwritable_directory_warns_once_and_still_builds(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NUMATTN_KERNEL_CACHE", str(blocker / "kernels"))  # below a file: cannot be created
    with pytest.warns(kernel_cache.KernelCacheWarning, match="cannot store"):
        assert kernel_cache.cached_kernel("u" * 64, entry) == entry()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_cache.cached_kernel("u" * 64, entry) == entry()


def test_processes_starting_together_build_each_kernel_once(cache_dir, tmp_path):
    """Four processes ask for the same two keys at once: each key is built by one of them, and every
    process gets the whole entry."""
    builds = tmp_path / "builds"
    script = textwrap.dedent(f"""
        import os, sys, time
        from numattn.kernels import kernel_cache
        def build(key):
            with open({str(builds)!r}, "a") as log:
                log.write(key[0] + "\\n")
            time.sleep(0.5)
            return kernel_cache.Entry("label " + key[0], "_Z6kernel", key.encode() * 1000)
        for key in ("a" * 64, "b" * 64):
            got = kernel_cache.cached_kernel(key, lambda: build(key))
            assert got.cubin == key.encode() * 1000, "wrong entry"
    """)
    env = {"NUMATTN_KERNEL_CACHE": str(cache_dir), "NUMBA_ENABLE_CUDASIM": "1", "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert sorted(builds.read_text().split()) == ["a", "b"]
    assert [label for _, label, _ in kernel_cache.entries()] == ["label a", "label b"]


def test_cache_info_and_clear_on_the_command_line(cache_dir, capsys):
    from numattn.__main__ import main

    kernel_cache.cached_kernel("c" * 64, entry)
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache_dir) in out and "1 compiled kernels" in out and "kernel A" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 1" in capsys.readouterr().out
    assert kernel_cache.entries() == [] and not list(cache_dir.glob("*.lock"))


_CUBIN_SCRIPT = textwrap.dedent("""
    import gc, sys, types
    from numba import cuda
    from numba.cuda import codegen
    # no GPU here: numba's current device and the code library's target (asked of a context) are sm_90's,
    # and numba's kernel object is not loaded into a context after its compile
    cuda.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
    import numba.cuda.dispatcher
    numba.cuda.dispatcher.get_current_device = cuda.get_current_device
    numba.cuda.dispatcher._Kernel.bind = lambda self: None
    ensure_cc = codegen.CUDACodeLibrary._ensure_cc
    codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: ensure_cc(self, cc or (9, 0, "a"))
    from numattn.kernels import launch
    from numattn.ops.backward import _backward_specs
    spec = _backward_specs("bfloat16", 64, 64, True, None)["rows"]
    dispatcher = spec.factory(*spec.args)
    if sys.argv[1] == "numba":  # numba's kernel object, as numba compiles it for a launch
        library = dispatcher.compile(spec.argtypes)._codelibrary
        name, cubin = library._entry_name, bytes(library.get_cubin().code)
    else:
        entry = launch._compile(dispatcher, spec.argtypes, spec.label)
        name, cubin = entry.entry_name, entry.cubin
        assert [label for label, _ in launch.COMPILES] == [spec.label]  # each compile is timed
        assert gc.isenabled()  # the collector, paused while compiling, runs again
    sys.stdout.buffer.write(name.encode() + b"\\n" + cubin)
""")


@pytest.mark.ptx
def test_compile_links_numbas_cubin():
    """numattn's compile (``launch._compile``: numba's steps without the PTX listing that numba's kernel object
    makes, a second NVVM run) links the very cubin, entry name included, that numba's kernel object links: each
    in a fresh process (numba numbers its compiled functions in the order a process compiles them). numattn's
    compile, run in one chunk of Python's frame stack with the garbage collector paused, is listed in
    ``launch.COMPILES`` and leaves the collector running."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    cubins = [subprocess.run([sys.executable, "-c", _CUBIN_SCRIPT, way], env=env, capture_output=True, timeout=600)
              for way in ("numba", "numattn")]
    for done in cubins:
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(cubins[0].stdout) > 1000 and cubins[0].stdout == cubins[1].stdout


@pytest.mark.parametrize("enabled", [True, False])
def test_a_compile_leaves_the_garbage_collector_as_it_found_it(enabled):
    """``launch._compile`` pauses Python's garbage collector while numba compiles; afterwards the collector
    is as it was, whether the compile returned or raised."""
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with launch._collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(ZeroDivisionError), launch._collector_paused():
            divmod(1, 0)
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_quicker_option_values_are_numbas():
    """The options' dictionary a compile builds without a property call per option is the one numba's
    ``TargetConfig.values`` builds: with no option set, some set, and after an option is deleted again;
    equal configurations hash alike."""
    from numba.cuda.core.targetconfig import TargetConfig
    from numba.cuda.flags import Flags

    numbas = TargetConfig.__dict__["values"]
    numbas = numbas if numbas is not launch._option_values else None
    config, other = Flags(), Flags()
    for step in (lambda: None, lambda: setattr(config, "fastmath", True), lambda: setattr(config, "boundscheck", True),
                 lambda: setattr(config, "error_model", "numpy"), lambda: delattr(config, "boundscheck")):
        step()
        values = launch._option_values(config)
        assert list(values) == list(Flags.options)
        assert values == {name: getattr(config, name) for name in Flags.options}
        if numbas is not None:
            assert values == numbas(config)
    other.fastmath, other.error_model = True, "numpy"
    launch._quicker_option_values()
    assert TargetConfig.values is launch._option_values
    assert config == other and hash(config) == hash(other) and config != Flags()


def test_a_compile_runs_through_one_frame_stack_chunk():
    """The call that runs a compile in one chunk of Python's frame stack passes its arguments through and
    returns the result, exceptions included, at any depth of the caller's stack."""
    def nested(depth):
        return launch._in_one_stack_chunk(divmod, 17, 5) if depth == 0 else nested(depth - 1)

    assert [nested(depth) for depth in (0, 50, 400)] == [(3, 2)] * 3
    with pytest.raises(ZeroDivisionError):
        launch._in_one_stack_chunk(divmod, 1, 0)


@pytest.mark.ptx
def test_the_compile_ahead_worker_needs_no_gpu(cache_dir):
    """The worker that compiles kernels ahead (``python -m numattn.kernels.compile_ahead``, given the
    compute capability and the kernel specs on stdin) compiles them into the cache with no CUDA context: here
    on a machine without a GPU."""
    import pickle

    from numattn.ops.backward import _backward_specs

    spec = _backward_specs("bfloat16", 64, 64, True, None)["rows"]
    job = ((9, 0), [spec])
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "numattn.kernels.compile_ahead"], input=pickle.dumps(job), env=env,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert [label for _, label, _ in kernel_cache.entries(cache_dir)] == [spec.label]
