"""Builders for small inline trace fixtures (written to tmp_path by the tests)."""
import gzip
import json


def weka_request(t, num_in, hash_ids, out=10, think=None, api=None, **extra):
    req = {"t": t, "type": "n", "model": "m", "in": num_in, "out": out, "hash_ids": list(hash_ids),
           "input_types": ["text"], "output_types": ["text"], "stop": "end_turn"}
    if think is not None:
        req["think_time"] = think
    if api is not None:
        req["api_time"] = api
    req.update(extra)
    return req


def weka_subagent(t, duration_s, requests, agent_id="agent_001"):
    return {"t": t, "type": "subagent", "agent_id": agent_id, "subagent_type": "Explore",
            "duration_ms": duration_s * 1000, "total_tokens": 0, "tool_use_count": 0, "status": "completed",
            "models": ["m"], "tool_tokens": 0, "system_tokens": 0, "requests": requests}


def weka_session(session_id, requests, block_size=64):
    return {"id": session_id, "models": ["m"], "block_size": block_size, "hash_id_scope": "local",
            "tool_tokens": 0, "system_tokens": 0, "totals": {}, "requests": requests}


def write_jsonl(path, records, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def ids(start, n):
    return list(range(start, start + n))
