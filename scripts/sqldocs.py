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

consts = {}
lines = src.split("\n")
i = 0
while i < len(lines):
    m = re.match(r'pub const ([A-Z0-9_]+): &str =( "(.*))?$', lines[i])
    if not m:
        i += 1
        continue
    name, first = m.group(1), m.group(3)
    start = i
    if first is None:  # `=` at the end of the line, the string on the next
        i += 1
        first = lines[i].strip()[1:]
    i, j = start, start - 1
    if lines[start].rstrip().endswith("="):
        i += 1
    comment = []
    while j >= 0 and lines[j].startswith("///"):
        comment.insert(0, lines[j][3:].strip())
        j -= 1
    body = [first]
    while not body[-1].endswith('";'):
        i += 1
        body.append(re.sub(r"^ {1,5}", "", lines[i]))
    body[-1] = body[-1][: -len('";')]
    text = "\n".join(body).replace('\\"', '"')
    consts[name] = (" ".join(comment), text)
    i += 1

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
