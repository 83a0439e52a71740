"""Input formats: validate one record and normalise it to a document or a conversation.

  text      {"text": str}                                     -> str (phase 1)
  messages  {"messages": [{"role", "content"}, ...]}          -> list of turns (phase 2)
  alpaca    {"instruction": str, "input": str?, "output": str} -> list of turns (phase 2)
  preference {"prompt"?, "chosen", "rejected"} (TRL's forms)    -> a pair (dataset/preference.py)

Validation raises `InvalidRecord(reason, detail)`; the reason codes are what stats.json
counts. `columns` maps our field names to the record's own (e.g. {"text": "content"}).
"""

from __future__ import annotations

from dataset.errors import InvalidRecord

RECORD_FORMATS = ("text", "messages", "alpaca", "preference")
PHASE_OF_FORMAT = {"text": 1, "messages": 2, "alpaca": 2, "preference": "preference"}
ROLES = ("system", "user", "assistant")


def remap_columns(record: dict, columns: dict[str, str] | None) -> dict:
    """Rename the record's columns to ours: columns = {our_name: their_name}."""
    if not columns:
        return record
    renamed = dict(record)
    for ours, theirs in columns.items():
        if theirs in record:
            renamed[ours] = record[theirs]
    return renamed


def detect_format(record: dict) -> str | None:
    """The format a record looks like, or None. Checked in this order: a record with "chosen" and
    "rejected" is a preference pair; one with "messages" is a conversation even if it also carries
    a "text" column."""
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "messages" in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "text" in record:
        return "text"
    return None


def require_string(record: dict, field: str, where: str = "") -> str:
    if field not in record:
        raise InvalidRecord("missing_field", f"missing field {where}{field!r}")
    value = record[field]
    if not isinstance(value, str):
        raise InvalidRecord("wrong_type", f"field {where}{field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidRecord("empty_content", f"field {where}{field!r} is empty")
    return value


def normalize_text(record: dict) -> str:
    return require_string(record, "text")


def normalize_messages(record: dict) -> list[dict]:
    if "messages" not in record:
        raise InvalidRecord("missing_field", "missing field 'messages'")
    turns = record["messages"]
    if not isinstance(turns, list):
        raise InvalidRecord("wrong_type", f"field 'messages' must be a list, got {type(turns).__name__}")
    messages = []
    for index, turn in enumerate(turns):
        where = f"messages[{index}]."
        if not isinstance(turn, dict):
            raise InvalidRecord("wrong_type", f"messages[{index}] must be an object, got {type(turn).__name__}")
        if "role" not in turn:
            raise InvalidRecord("missing_field", f"missing field {where}'role'")
        role = turn["role"]
        if role not in ROLES:
            raise InvalidRecord("unknown_role", f"{where}role is {role!r}; expected one of {list(ROLES)}")
        messages.append({"role": role, "content": require_string(turn, "content", where)})
    check_turn_order(messages)
    return messages


def check_turn_order(messages: list[dict]) -> None:
    """An optional leading system turn, then user/assistant alternating, ending with assistant."""
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise InvalidRecord("no_assistant_turn", "conversation has no assistant turn (nothing to train on)")
    start = 1 if roles[0] == "system" else 0
    for index in range(start, len(roles)):
        expected = "user" if (index - start) % 2 == 0 else "assistant"
        if roles[index] != expected:
            raise InvalidRecord(
                "bad_turn_order",
                f"messages[{index}] is {roles[index]!r} but {expected!r} was expected "
                "(an optional first system turn, then user and assistant alternating)",
            )
    if roles[-1] != "assistant":
        raise InvalidRecord(
            "not_ending_with_assistant", f"conversation ends with a {roles[-1]!r} turn, not an assistant turn"
        )


def alpaca_to_messages(record: dict) -> list[dict]:
    """Alpaca -> chat: the instruction (and the input, after a blank line) is the user turn."""
    instruction = require_string(record, "instruction")
    output = require_string(record, "output")
    extra = record.get("input", "")
    if extra is None:
        extra = ""
    if not isinstance(extra, str):
        raise InvalidRecord("wrong_type", f"field 'input' must be a string, got {type(extra).__name__}")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


NORMALIZERS = {"text": normalize_text, "messages": normalize_messages, "alpaca": alpaca_to_messages}


def normalize(record: dict, record_format: str) -> str | list[dict]:
    """The document (text) or conversation (messages, alpaca) inside a validated record (a
    preference pair's: dataset/preference.py's normalize_preference, which builds on these checks)."""
    return NORMALIZERS[record_format](record)
