#!/usr/bin/env python3
"""kvxfer's layer rules, read from ARCHITECTURE.md and checked against the code.

Usage: layers.py [ARCHITECTURE.md [kvxfer/src]]

The layer table in ARCHITECTURE.md ("| layer | files | owns | must not import |") is the
allow-list. For kvxfer/src it checks:
  1. every .rs file is named in the table's files column (brace groups are expanded), and every
     file named there exists: the table is the whole map;
  2. a module imports only modules of its own layer or below (L1 < L2 < ... < L6; `lib.rs`, the
     API row, may import anything), and none that its row's "must not import" column names in
     backticks;
  3. no module imports a name through `lib.rs` (import it from the module that defines it),
     and no file imports the `mod.rs` of a directory it is inside (children never import
     their parent: shared pieces live in a sibling file);
  4. no cycle between directories: the import graph with every top-level module (a file or a
     directory with everything below it) as one node has no cycle. The file-level check
     (module-cycles.py) cannot see a cycle that runs through different files of a directory.
Imports are read by module-cycles.py's rules (`crate::`/`super::` paths, `use child::`, test
code left out). Exit status 1 on any violation."""
import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load_cycles():
    spec = importlib.util.spec_from_file_location("module_cycles", os.path.join(HERE, "module-cycles.py"))
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def expand_braces(item):
    """'a/{b,c}.rs' -> ['a/b.rs', 'a/c.rs']."""
    m = re.match(r"^(.*)\{([^}]*)\}(.*)$", item)
    if not m:
        return [item]
    return [x for part in m.group(2).split(",") for x in expand_braces(m.group(1) + part.strip() + m.group(3))]


def top(path):
    """The top-level module of a file path relative to src ('lane/tcp/link.rs' -> 'lane')."""
    first = path.split("/")[0]
    return first[:-3] if first.endswith(".rs") else first


def through_lib(cyc, f, mods):
    """The `crate::` paths in `f` that name an item of lib.rs rather than a module (a macro's
    `$crate::name!` is at the crate root by Rust's rules and does not count)."""
    text = open(f, encoding="utf-8", errors="replace").read()
    cut = re.search(r"^\s*#\[cfg\(test\)\]\s*\n(\s*#\[[^\n]*\]\s*\n)*\s*mod\s+\w+\s*\{", text, re.M)
    text = re.sub(r"//[^\n]*", "", text[: cut.start()] if cut else text)
    paths = [p for u in cyc.USE_RE.findall(text) for p in cyc.expand(u) if p.startswith("crate::")]
    paths += ["crate::" + m for m in re.findall(r"(?<![$\w])crate::(\w+)(?!\w*!)", text)]
    heads = {p.split("::")[1] for p in paths if len(p.split("::")) > 1}
    return sorted(h for h in heads if (h,) not in mods and h not in ("self", "*"))


def read_table(md):
    rows = []
    lines = open(md, encoding="utf-8").read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| layer | files"))
    for l in lines[start + 2:]:
        if not l.startswith("|"):
            break
        cells = [c.strip() for c in l.strip().strip("|").split("|")]
        layer, files, _, forbidden = cells[0], cells[1], cells[2], cells[3]
        rank = 99 if layer == "API" else int(layer.lstrip("L"))
        items = [f for it in re.findall(r"`([^`]+)`", files) for f in expand_braces(it)]
        rows.append((rank, items, re.findall(r"`([^`]+)`", forbidden)))
    return rows


def main():
    md = sys.argv[1] if len(sys.argv) > 1 else "ARCHITECTURE.md"
    src = sys.argv[2] if len(sys.argv) > 2 else "kvxfer/src"
    cyc = load_cycles()
    mods, edges = cyc.crate_graph(src)
    bad = []

    layer, forbid, listed = {}, {}, set()
    for rank, items, forbidden in read_table(md):
        for f in items:
            listed.add(f)
            t = top(f)
            if layer.get(t, rank) != rank:
                bad.append(f"table: {t} is in layers {layer[t]} and {rank}")
            layer[t] = rank
            forbid.setdefault(t, set()).update(forbidden)
    actual = {os.path.relpath(f, src).replace(os.sep, "/") for f in mods.values()}
    for f in sorted(actual - listed):
        bad.append(f"{f}: not in ARCHITECTURE.md's layer table")
    for f in sorted(listed - actual):
        bad.append(f"ARCHITECTURE.md's layer table names {f}, which does not exist")

    name = {m: os.path.relpath(f, src).replace(os.sep, "/") for m, f in mods.items()}
    graph = {}
    for a, targets in edges.items():
        ta = top(name[a])
        for b in targets:
            tb = top(name[b])
            if b == ():
                for p in through_lib(cyc, mods[a], mods):
                    bad.append(f"{name[a]} imports crate::{p} through lib.rs (import it from the module that defines it)")
                continue
            if name[b].endswith("mod.rs") and len(a) > len(b) and a[: len(b)] == b:
                bad.append(f"{name[a]} imports its parent {name[b]} (put the shared piece in a sibling file)")
            if ta == tb or ta == "lib":
                continue
            graph.setdefault(ta, set()).add(tb)
            la, lb = layer.get(ta), layer.get(tb)
            if la is not None and lb is not None and lb > la:
                bad.append(f"{name[a]} (L{la}) imports {name[b]} (L{lb}): a layer above")
            if tb in forbid.get(ta, ()):
                bad.append(f"{name[a]} imports {name[b]}: its row says it must not import `{tb}`")
    nodes = {t: graph.get(t, set()) for t in set(graph) | {x for v in graph.values() for x in v}}
    for comp in cyc.sccs(nodes):
        bad.append(f"cycle between directories: {' -> '.join(sorted(comp))}")

    for b in bad:
        print(f"  {b}")
    print(f"{src}: {len(mods)} files in {len(layer)} top-level modules, "
          f"{sum(len(v) for v in graph.values())} imports between them, {len(bad)} violations")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
