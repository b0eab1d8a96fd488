"""SQLite observer: reads the actual rows and schema of the agent's final database.

Runs as `python3 -I -S -c` in the verification sandbox; no agent code runs in this process. The
database file must be a regular file (not a symlink); triggers and views are reported, not trusted;
`trusted_schema=OFF` and a progress limit stop a crafted schema from running long or doing much.

Each schema object's kind is read from its SQL, as SQLite's own schema loader does: the `type` column is
only a label, and `PRAGMA writable_schema` lets the agent set it to anything ('Trigger', or 'table' on a
CREATE TRIGGER). Both are reported; the host compares them.
"""
import json
import os
import re
import sqlite3
import stat
import sys


def value(v):
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, float) and v != v:
        return {"$float": "nan"}
    return v


_WORD = re.compile(r"[A-Za-z_]+")
_SPACE = " \t\n\f\r\v"  # SQLite's whitespace


def sql_kind(sql):
    """The object a CREATE statement makes, read the way SQLite's tokenizer reads it (any case, any spacing,
    comments between the words; TEMP, UNIQUE and IF NOT EXISTS aside): 'table', 'virtual table', 'view',
    'index', 'trigger', or None for anything else."""
    words, i, n = [], 0, len(sql or "")
    while sql and i < n and len(words) < 5:
        if sql[i] in _SPACE:
            i += 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            m = _WORD.match(sql, i)
            if not m:
                break
            words.append(m.group().lower())
            i = m.end()
    if words[:1] != ["create"]:
        return None
    rest = [w for w in words[1:] if w not in ("temp", "temporary", "unique")]
    if rest[:2] == ["virtual", "table"]:
        return "virtual table"
    return rest[0] if rest and rest[0] in ("table", "view", "index", "trigger") else None


def main():
    payload = json.loads(sys.stdin.buffer.read())
    path = os.path.join(payload["root"], payload["db"])
    out = {}
    try:
        st = os.lstat(path)
        problem = None if stat.S_ISREG(st.st_mode) else "is not a regular file"
    except OSError as e:
        problem = "is missing (%s)" % e.strerror
    if problem:
        err = {"error": "database %s %s" % (payload["db"], problem)}
        print(json.dumps({q["id"]: err for q in payload["queries"]}))
        return
    conn = sqlite3.connect(path, timeout=1.0)
    conn.execute("PRAGMA trusted_schema=OFF")
    budget = [2000]  # progress callbacks of 10k VM steps each: 20M steps in all

    def progress():
        budget[0] -= 1
        return 1 if budget[0] <= 0 else 0

    conn.set_progress_handler(progress, 10000)
    for q in payload["queries"]:
        try:
            if q["kind"] == "sql_schema":
                rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name")
                objects = [[t, name, tbl, sql_kind(sql)] for t, name, tbl, sql in rows.fetchall()]
                integrity = conn.execute("PRAGMA integrity_check").fetchall()
                # a "table" can still compute its values at read time: a virtual table, or generated columns
                # (pragma table_xinfo hidden 2 = virtual, 3 = stored generated; both are expressions, not data)
                virtual, generated = [], {}
                for _, name, _, kind in objects:
                    if kind == "virtual table":
                        virtual.append(name)
                    if kind != "table":
                        continue
                    cols = [r[0] for r in conn.execute(
                        "SELECT name FROM pragma_table_xinfo(?) WHERE hidden IN (2, 3)", (name,))]
                    if cols:
                        generated[name] = cols
                out[q["id"]] = {"objects": [list(r) for r in objects],
                                "integrity": [r[0] for r in integrity],
                                "virtual_tables": virtual, "generated_columns": generated}
            else:
                rows = conn.execute(q["sql"]).fetchmany(100001)
                out[q["id"]] = {"rows": [[value(v) for v in r] for r in rows]}
        except Exception as e:
            out[q["id"]] = {"error": "%s: %s" % (type(e).__name__, e)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
