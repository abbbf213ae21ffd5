#!/usr/bin/env python3
"""The public API of a crate as sorted text lines, from rustdoc's JSON output.

Usage: public-api.py CRATE.json > api.txt

One line per public item as a user reaches it (walking the crate's public modules and
re-exports from the root): its path, its kind, and for functions, methods, fields, variants,
constants and statics their types; a re-export of another crate's item is listed by the path
it has here with its origin. Inherent methods and the traits a type implements (not the
automatic or blanket ones) are listed under the type. Two items reachable by two paths are
listed twice: `docs/api/*.txt` then shows it, and the API's rule is one path per item.

scripts/api.sh writes docs/api/ with it and checks the committed copy (CI), so every change of
the public API shows in a diff."""
import json
import sys


def render(t):
    """A rustdoc JSON type as Rust-like text."""
    if t is None:
        return "()"
    (k, v), = t.items()
    if k == "resolved_path":
        args = v.get("args")
        s = v["path"]
        if args and "angle_bracketed" in args:
            parts = []
            for a in args["angle_bracketed"]["args"]:
                if "type" in a:
                    parts.append(render(a["type"]))
                elif "lifetime" in a:
                    parts.append(a["lifetime"])
                elif "const" in a:
                    parts.append(str(a["const"].get("expr", "_")))
            for c in args["angle_bracketed"].get("constraints", []):
                b = c.get("binding", {})
                if "equality" in b and "type" in b["equality"]:
                    parts.append(f"{c['name']} = {render(b['equality']['type'])}")
            if parts:
                s += "<" + ", ".join(parts) + ">"
        elif args and "parenthesized" in args:
            p = args["parenthesized"]
            s += "(" + ", ".join(render(x) for x in p["inputs"]) + ")"
            if p.get("output"):
                s += " -> " + render(p["output"])
        return s
    if k == "primitive":
        return v
    if k == "generic":
        return v
    if k == "borrowed_ref":
        lt = (v.get("lifetime") or "") + " " if v.get("lifetime") else ""
        return "&" + lt + ("mut " if v["is_mutable"] else "") + render(v["type"])
    if k == "raw_pointer":
        return "*" + ("mut " if v["is_mutable"] else "const ") + render(v["type"])
    if k == "slice":
        return "[" + render(v) + "]"
    if k == "array":
        return "[" + render(v["type"]) + "; " + str(v["len"]) + "]"
    if k == "tuple":
        return "(" + ", ".join(render(x) for x in v) + ")"
    if k in ("impl_trait", "dyn_trait"):
        bounds = v if k == "impl_trait" else v["traits"]
        names = []
        for b in bounds:
            tb = b.get("trait_bound", b)
            if "trait" in tb:
                names.append(render({"resolved_path": tb["trait"]}))
        return ("impl " if k == "impl_trait" else "dyn ") + " + ".join(names)
    if k == "qualified_path":
        return f"<{render(v['self_type'])}>::{v['name']}"
    if k == "function_pointer":
        d = v["sig"]
        return "fn(" + ", ".join(render(x[1]) for x in d["inputs"]) + ")" + (
            " -> " + render(d["output"]) if d.get("output") else "")
    return k


def fn_sig(f):
    sig = f["sig"]
    ins = ", ".join(f"{n}: {render(t)}" if n != "self" else render(t) for n, t in sig["inputs"])
    out = sig.get("output")
    unsafe = "unsafe " if f["header"].get("is_unsafe") else ""
    return f"{unsafe}fn({ins})" + (f" -> {render(out)}" if out else "")


class Api:
    def __init__(self, doc):
        self.doc = doc
        self.index = doc["index"]
        self.lines = set()
        self.seen_types = set()

    def item(self, i):
        return self.index.get(str(i))

    def add(self, line):
        self.lines.add(line)

    def walk_module(self, path, mod_id, depth=0):
        if depth > 20:
            return
        m = self.item(mod_id)
        for i in m["inner"]["module"]["items"]:
            it = self.item(i)
            if it is None or it["visibility"] != "public":
                continue
            self.visit(path, it, depth)

    def visit(self, path, it, depth):
        (kind, inner), = it["inner"].items()
        if kind == "use":
            target = self.item(inner["id"]) if inner.get("id") is not None else None
            name = inner["name"]
            if inner["is_glob"]:
                if target and "module" in target["inner"]:
                    self.walk_module(path, inner["id"], depth + 1)
                else:
                    self.add(f"{path}::* (glob re-export of {inner['source']})")
                return
            if target is None:
                self.add(f"{path}::{name} (re-export of {inner['source']})")
                return
            it = dict(target, name=name)
            (kind, inner), = it["inner"].items()
        p = f"{path}::{it['name']}"
        if kind == "module":
            self.add(f"{p} (mod)")
            self.walk_module(p, it["id"], depth + 1)
        elif kind == "function":
            self.add(f"{p} {fn_sig(inner)}")
        elif kind in ("struct", "enum", "union", "trait"):
            ne = any("non_exhaustive" in str(a) for a in it.get("attrs", []))
            self.add(f"{p} ({kind}{', non_exhaustive' if ne else ''})")
            self.members(p, kind, inner)
        elif kind == "type_alias":
            self.add(f"{p} (type = {render(inner['type'])})")
        elif kind == "constant":
            self.add(f"{p} (const: {render(inner['type'])})")
        elif kind == "static":
            self.add(f"{p} (static: {render(inner['type'])})")
        elif kind == "macro":
            self.add(f"{p}! (macro)")
        else:
            self.add(f"{p} ({kind})")

    def members(self, p, kind, inner):
        if kind == "struct":
            k = inner["kind"]
            if "plain" in k:
                for f in k["plain"]["fields"]:
                    fi = self.item(f)
                    if fi and fi["visibility"] == "public":
                        self.add(f"{p}.{fi['name']}: {render(fi['inner']['struct_field'])}")
                if k["plain"].get("has_stripped_fields"):
                    self.add(f"{p} (has private fields)")
            elif "tuple" in k:
                pub = [self.item(f) for f in k["tuple"] if f is not None]
                self.add(f"{p} (tuple: " + ", ".join(render(f["inner"]["struct_field"]) for f in pub if f) + ")")
        if kind == "enum":
            for v in inner["variants"]:
                vi = self.item(v)
                self.add(f"{p}::{vi['name']} (variant)")
        if kind == "trait":
            for m in inner["items"]:
                mi = self.item(m)
                if mi and "function" in mi["inner"]:
                    self.add(f"{p}::{mi['name']} (trait method) {fn_sig(mi['inner']['function'])}")
            return
        for i in inner.get("impls", []):
            im = self.item(i)
            if im is None:
                continue
            imp = im["inner"]["impl"]
            if imp.get("is_synthetic") or imp.get("blanket_impl"):
                continue
            if imp.get("trait"):
                self.add(f"{p}: impl {render({'resolved_path': imp['trait']})}")
                continue
            for m in imp["items"]:
                mi = self.item(m)
                if mi and mi["visibility"] == "public" and "function" in mi["inner"]:
                    self.add(f"{p}::{mi['name']} (method) {fn_sig(mi['inner']['function'])}")
                elif mi and mi["visibility"] == "public" and "assoc_const" in mi["inner"]:
                    self.add(f"{p}::{mi['name']} (assoc const)")


# The rustdoc JSON format this reader was written for (nightly 2026-05).
FORMAT = 57


def main():
    doc = json.load(open(sys.argv[1]))
    if doc.get("format_version") != FORMAT:
        print(f"public-api.py: rustdoc JSON format {doc.get('format_version')}, written for {FORMAT}: "
              "check the listing by hand before committing it", file=sys.stderr)
    api = Api(doc)
    root = api.item(doc["root"])
    api.walk_module(root["name"], doc["root"])
    for l in sorted(api.lines):
        print(l)


if __name__ == "__main__":
    main()
