"""SQLite observer: reads the actual rows and schema of the agent's final database.

Runs as `python3 -I -S -c` in the verification sandbox; no agent code runs in this process. The
database file must be a regular file (not a symlink); triggers and views are reported, not trusted;
`trusted_schema=OFF` and a progress limit stop a crafted schema from running long or doing much.
"""
import json
import os
import sqlite3
import stat
import sys


def value(v):
    if isinstance(v, bytes):
        return {"$bytes": v.hex()}
    if isinstance(v, float) and v != v:
        return {"$float": "nan"}
    return v


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
                objects = conn.execute(
                    "SELECT type, name, tbl_name FROM sqlite_master ORDER BY type, name").fetchall()
                integrity = conn.execute("PRAGMA integrity_check").fetchall()
                # a "table" can still compute its values at read time: a virtual table, or generated columns
                # (pragma table_xinfo hidden 2 = virtual, 3 = stored generated; both are expressions, not data)
                virtual, generated = [], {}
                for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"):
                    if (sql or "").lstrip().upper().startswith("CREATE VIRTUAL TABLE"):
                        virtual.append(name)
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
