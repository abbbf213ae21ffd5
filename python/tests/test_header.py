"""The ctypes bindings (kvxfer_vllm/lib.py) against the C header (include/kvxfer.h, which
cbindgen writes from the Rust source and tests/c_abi.rs keeps current): every bound function's
result and argument types, every structure's fields, every status constant. Needs neither
vLLM nor libkvxfer: lib.py is loaded as a file, the header parsed as text."""

import ctypes
import importlib.util
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
HEADER = os.path.join(ROOT, "include", "kvxfer.h")


def load_bindings():
    spec = importlib.util.spec_from_file_location(
        "kvxfer_lib_under_test", os.path.join(ROOT, "python", "kvxfer_vllm", "lib.py")
    )
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def header_text():
    with open(HEADER) as f:
        text = f.read()
    # Comments and preprocessor lines say nothing about types.
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))


class Header:
    """What include/kvxfer.h declares."""

    def __init__(self, text):
        self.constants = {}
        for name, value in re.findall(r"\b(KVX_[A-Z0-9_]+)\s*=\s*(\d+)", text):
            self.constants[name] = int(value)
        with open(HEADER) as f:
            for name, value in re.findall(r"#define\s+(KVX_[A-Z0-9_]+)\s+(\d+)", f.read()):
                self.constants[name] = int(value)
        # Enumerations are uint32_t in the C ABI.
        self.u32_types = set(re.findall(r"typedef\s+uint32_t\s+(\w+)\s*;", text))
        self.opaque = set(re.findall(r"typedef\s+struct\s+(\w+)\s+\1\s*;", text))
        self.structs = {}
        for name, body in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", text, re.S):
            fields = []
            for decl in body.split(";"):
                decl = " ".join(decl.split())
                if decl:
                    ctype, field = split_decl(decl)
                    fields.append((field, ctype))
            self.structs[name] = fields
        self.functions = {}
        for ret, name, args in re.findall(r"([\w\s\*]+?)\s*\b(kvx_\w+)\s*\(([^)]*)\)\s*;", text):
            ret = " ".join(ret.split())
            args = " ".join(args.split())
            params = [] if args in ("", "void") else [split_decl(a.strip())[0] for a in args.split(",")]
            self.functions[name] = (ret, params)


def split_decl(decl):
    """'const struct kvx_layout *layout' -> ('const struct kvx_layout *', 'layout')."""
    m = re.match(r"^(.*?[\s\*])(\w+)$", decl)
    assert m, f"cannot read the declaration {decl!r}"
    ctype = re.sub(r"\s*\*", " *", m.group(1).strip())
    return " ".join(ctype.split()), m.group(2)


SCALARS = {
    "uint8_t": ctypes.c_uint8,
    "uint32_t": ctypes.c_uint32,
    "uint64_t": ctypes.c_uint64,
    "int32_t": ctypes.c_int32,
    "size_t": ctypes.c_size_t,
    "char": ctypes.c_char,
}


def describe(t):
    """A ctypes type as comparable text."""
    if t is None:
        return "void"
    if hasattr(t, "_type_") and issubclass(t, ctypes._Pointer):
        return f"pointer to {describe(t._type_)}"
    return getattr(t, "_c_name_", t.__name__)


def expected(ctype, header, structs_by_c_name):
    """The ctypes type that matches the C type `ctype`, as `describe` writes it."""
    base = ctype.replace("const ", "").strip()
    stars = base.count("*")
    base = base.replace("*", "").strip()
    if base == "void" and stars == 0:
        return "void"
    if base == "char" and stars == 1 and ctype.startswith("const"):
        return describe(ctypes.c_char_p)
    if base == "void" and stars == 1:
        return describe(ctypes.c_void_p)
    if base.startswith("struct "):
        name = base.split()[1]
        if name in header.opaque:
            # A handle: void * by value, pointer to void * for an out-parameter.
            inner = describe(ctypes.c_void_p)
            return inner if stars == 1 else "pointer to " * (stars - 1) + inner
        if name in header.structs:
            assert name in structs_by_c_name, f"no ctypes Structure for {name}"
            return "pointer to " * stars + name
        raise AssertionError(f"unknown struct {name}")
    if base in header.u32_types:
        base = "uint32_t"
    assert base in SCALARS, f"no ctypes type for {ctype!r}"
    return "pointer to " * stars + describe(SCALARS[base])


@pytest.fixture(scope="module")
def both():
    lib = load_bindings()
    header = Header(header_text())
    structs = {
        getattr(v, "_c_name_"): v
        for v in vars(lib).values()
        if isinstance(v, type) and issubclass(v, ctypes.Structure) and hasattr(v, "_c_name_")
    }
    return lib, header, structs


def test_the_header_was_read(both):
    _, header, _ = both
    # A parser that finds nothing (or half) would pass everything below: it must find every
    # prototype, counted here a second way (one per line that opens one).
    with open(HEADER) as f:
        opened = re.findall(r"^[a-z][\w\s\*]*\bkvx_\w+\(", f.read(), re.M)
    assert len(opened) > 50 and len(header.functions) == len(opened), sorted(header.functions)
    assert "kvx_producer_publish" in header.functions
    assert header.constants["KVX_OK"] == 0
    assert "kvx_layout" in header.structs and "kvx_agent" in header.opaque


def test_every_bound_function_matches_its_prototype(both):
    lib, header, structs = both
    assert lib.SIGNATURES, "no signatures in lib.py"
    wrong = []
    for name, (res, args) in lib.SIGNATURES.items():
        if name not in header.functions:
            wrong.append(f"{name}: not in include/kvxfer.h")
            continue
        ret, params = header.functions[name]
        want = [expected(ret, header, structs)] + [expected(p, header, structs) for p in params]
        got = [describe(res)] + [describe(a) for a in args]
        if want != got:
            wrong.append(f"{name}: header {want}, lib.py {got}")
    assert not wrong, "\n".join(wrong)


def test_every_structure_matches_its_c_struct(both):
    _, header, structs = both
    assert structs, "no Structure in lib.py names its C struct"
    wrong = []
    for c_name, cls in structs.items():
        if c_name not in header.structs:
            wrong.append(f"{cls.__name__}: {c_name} is not in include/kvxfer.h")
            continue
        want = [(f, expected(t, header, structs)) for f, t in header.structs[c_name]]
        got = [(f, describe(t)) for f, t in cls._fields_]
        if want != got:
            wrong.append(f"{cls.__name__}: header {want}, lib.py {got}")
    assert not wrong, "\n".join(wrong)


def test_every_status_constant_matches(both):
    lib, header, _ = both
    ours = {k: v for k, v in vars(lib).items() if k.startswith("KVX_") and isinstance(v, int)}
    assert ours, "no KVX_ constant in lib.py"
    wrong = {k: (v, header.constants.get(k)) for k, v in ours.items() if header.constants.get(k) != v}
    assert not wrong, f"lib.py value, header value: {wrong}"


def test_the_statuses_lib_names_are_the_headers(both):
    lib, header, _ = both
    # Every status of the header has a name in lib.py, so an error can be matched by name.
    statuses = {k for k in header.constants if not k.startswith("KVX_MAX_")}
    statuses -= {k for k in header.constants if k.startswith(("KVX_GPU_", "KVX_READ", "KVX_WRITE", "KVX_PACKING_", "KVX_NO_BLOCK"))}
    assert set(lib.STATUS_NAMES.values()) == statuses
