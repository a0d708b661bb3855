#!/usr/bin/env python3
"""Rewrites docs/cluster.md's last section, "## 7. Every statement", from src/pg/sql.rs: each
statement of `ALL`, in that order, with its doc comment and its text. The lib test
`docs_show_every_statement_as_it_is` fails until this is run after a change to a statement.

Usage: python3 scripts/sqldocs.py   (from anywhere; it finds the repository from its own path)
"""
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
src = (root / "src/pg/sql.rs").read_text()
doc_path = root / "docs/cluster.md"
doc = doc_path.read_text()

LIT = r'"((?:[^"\\]|\\.)*)"'


def literal_text(raw):
    """A Rust string literal's contents as the statement's text: continuation lines lose the
    indentation of the source (up to 5 spaces), escaped quotes are plain."""
    lines = raw.split("\n")
    return "\n".join([lines[0]] + [re.sub(r"^ {1,5}", "", l) for l in lines[1:]]).replace('\\"', '"')


def doc_above(at):
    """The `///` comment right above the line on which offset `at` starts."""
    before = src[: src.rfind("\n", 0, at) + 1].split("\n")[:-1]
    comment = []
    while before and before[-1].startswith("///"):
        comment.insert(0, before.pop()[3:].strip())
    return " ".join(comment)


# The shared parts: `macro_rules! name { () => { "..." }; }`, each one string literal.
macros = {}
for m in re.finditer(r"^macro_rules! ([a-z_]+) \{\n    \(\) => \{\n        " + LIT + r"\n    \};\n\}", src, re.M | re.S):
    macros[m.group(1)] = m.group(2)

# The statements: `pub const NAME: &str = "...";` or `= concat!(` of literals and shared parts `);`.
consts = {}
for m in re.finditer(r'^pub const ([A-Z0-9_]+): &str =\s*(concat!\((.*?)\n\);|' + LIT + ";)", src, re.M | re.S):
    name = m.group(1)
    if m.group(3) is not None:
        raw = ""
        for piece in re.finditer(LIT + r"|([a-z_]+)!\(\)", m.group(3), re.S):
            if piece.group(2) is not None:
                if piece.group(2) not in macros:
                    sys.exit(f"sqldocs: {name} uses {piece.group(2)}!() but no such macro_rules! is found")
                raw += macros[piece.group(2)]
            else:
                raw += piece.group(1)
    else:
        raw = m.group(4)
    consts[name] = (doc_above(m.start()), literal_text(raw))

all_block = re.search(r"pub const ALL: &\[\(&str, &str\)\] = &\[(.*?)\];", src, re.S)
if not all_block:
    sys.exit("sqldocs: no `ALL` list in src/pg/sql.rs")
names = re.findall(r'\("([A-Z0-9_]+)",', all_block.group(1))

out = ["## 7. Every statement", ""]
for name in names:
    if name not in consts:
        sys.exit(f"sqldocs: {name} is in ALL but not a `pub const` string")
    comment, text = consts[name]
    comment = re.sub(r"\[`([^`]+)`\]", r"`\1`", comment)
    out += [f"### `{name}`", ""]
    if comment:
        out += [comment, ""]
    out += ["```sql", text, "```", ""]

head, sep, _ = doc.partition("## 7. Every statement")
if not sep:
    sys.exit("sqldocs: docs/cluster.md has no '## 7. Every statement' section")
doc_path.write_text(head + "\n".join(out).rstrip("\n") + "\n")
print(f"sqldocs: {len(names)} statements written to docs/cluster.md")
