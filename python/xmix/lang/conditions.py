"""The condition language of ``.cond(...)``.

    cond    := or
    or      := and ("or" and)*
    and     := unary ("and" unary)*
    unary   := "not" unary | "(" cond ")" | atom
    atom    := "all" | "prompt" | "generated" | "last_token"
             | "token_in(" SET ")"
             | "in_span(" OPEN_SET "," CLOSE_SET ")"     # tokens from the opener up to,
                                                         # not including, the closer
             | READ CMP value                           # per-token gate on an earlier read
             | ("prompt_mean" | "prompt_last") "(" READ ")" CMP value
                                                         # request-level latch over the prompt
             | "since(" cond ")"                         # sticky: from the first token where
                                                         # cond held to the end of the request
    CMP     := ">=" | ">" | "<=" | "<" | "==" | "!="
    value   := NUMBER | PARAM                            # PARAM: a name declared by app.param()

``last_token`` is every token whose logits are sampled this step: the last prompt token and
every generated token. A latch is decided at the request's last prompt token and holds for
every later token; before that it is false. An op at a later site than the latch's read sees
it from the last prompt token on; an op at the read's site or before it, from the first
generated token on (in the last prompt token's forward it runs before the read has seen that
token). ``since(cond)`` holds from the first token at which ``cond`` held (that token
included; a prompt token too) to the end of the request, across prefill chunks and
preemption: it is decided right after the site of the last read ``cond`` names, so an op
using it must be at a later site (lowering says so otherwise); a ``since`` cannot contain
another. ``READ`` names a read of the same app (``name``,
or ``name.<layer>`` for a read placed on several layers, or ``name.f<id>`` for one feature of
an SAE read with ``features=[...]``: ``sae18.f1234 > 2.0``, docs/saes.md).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

FLAGS = ("all", "prompt", "generated", "last_token")
CMPS = (">=", ">", "<=", "<", "==", "!=")
REDUCES = ("prompt_mean", "prompt_last")
STICKY = "since"
RESERVED = frozenset(FLAGS + REDUCES + ("token_in", "in_span", STICKY, "and", "or", "not"))
MAX_DEPTH = 32  # nesting of parentheses / not; deeper texts are refused, not recursed into
MAX_TERMS = 256  # atoms in one condition; longer texts are refused before a tree is built
MAX_TEXT = 16384  # characters of one condition text


class ConditionError(ValueError):
    pass


@dataclass(frozen=True)
class Flag:
    name: str


@dataclass(frozen=True)
class TokenIn:
    set: str


@dataclass(frozen=True)
class InSpan:
    open: str
    close: str


@dataclass(frozen=True)
class Gate:
    read: str
    cmp: str
    value: float | str


@dataclass(frozen=True)
class Latch:
    reduce: str  # "prompt_mean" | "prompt_last"
    read: str
    cmp: str
    value: float | str


@dataclass(frozen=True)
class Since:
    """Sticky: holds from the first token of the request where ``a`` held, to its end."""

    a: Node


@dataclass(frozen=True)
class And:
    a: Node
    b: Node


@dataclass(frozen=True)
class Or:
    a: Node
    b: Node


@dataclass(frozen=True)
class Not:
    a: Node


Node = Flag | TokenIn | InSpan | Gate | Latch | Since | And | Or | Not

_TOKEN = re.compile(
    r"\s*(?:(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<cmp>>=|<=|==|!=|>|<)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)"
    r"|(?P<punct>[(),]))"
)


def _lex(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise ConditionError(f"cannot read condition {text!r} at {text[pos:]!r}")
        kind = m.lastgroup
        assert kind is not None  # every alternative of _TOKEN is a named group
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


class _Parser:
    def __init__(self, text: str):
        self.text = text
        if len(text) > MAX_TEXT:
            raise ConditionError(f"condition of {len(text)} characters; at most {MAX_TEXT}")
        self.toks = _lex(text)
        self.i = 0
        self.depth = 0
        self.terms = 0

    def peek(self) -> tuple[str | None, str | None]:
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self, kind: str | None = None, value: str | None = None) -> str:
        k, v = self.peek()
        if k is None or v is None or (kind and k != kind) or (value is not None and v != value):
            want = value or kind or "more input"
            got = v if v is not None else "end of condition"
            raise ConditionError(f"in condition {self.text!r}: expected {want}, got {got!r}")
        self.i += 1
        return v

    def parse(self) -> Node:
        if not self.toks:
            raise ConditionError("empty condition")
        node = self.or_()
        if self.i != len(self.toks):
            raise ConditionError(f"in condition {self.text!r}: unexpected {self.peek()[1]!r}")
        return node

    def or_(self) -> Node:
        node = self.and_()
        while self.peek() == ("name", "or"):
            self.i += 1
            node = Or(node, self.and_())
        return node

    def and_(self) -> Node:
        node = self.unary()
        while self.peek() == ("name", "and"):
            self.i += 1
            node = And(node, self.unary())
        return node

    def unary(self) -> Node:
        k, v = self.peek()
        if (k, v) in (("name", "not"), ("punct", "(")):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ConditionError(f"condition nested more than {MAX_DEPTH} levels deep")
            self.i += 1
            if v == "not":
                node: Node = Not(self.unary())
            else:
                node = self.or_()
                self.take("punct", ")")
            self.depth -= 1
            return node
        return self.atom()

    def value(self) -> float | str:
        k, v = self.peek()
        if k == "num" and v is not None:
            self.i += 1
            f = float(v)
            if f in (float("inf"), float("-inf")):
                raise ConditionError(f"in condition {self.text!r}: number {v} is out of range")
            return f
        if k == "name" and v is not None:
            self.i += 1
            return v
        raise ConditionError(f"in condition {self.text!r}: expected a number or parameter name")

    def atom(self) -> Node:
        self.terms += 1
        if self.terms > MAX_TERMS:
            raise ConditionError(f"condition has more than {MAX_TERMS} terms")
        name = self.take("name")
        if name in ("and", "or", "not"):
            raise ConditionError(f"in condition {self.text!r}: misplaced {name!r}")
        if name in FLAGS:
            return Flag(name)
        if name == "token_in":
            self.take("punct", "(")
            s = self.take("name")
            self.take("punct", ")")
            return TokenIn(s)
        if name == "in_span":
            self.take("punct", "(")
            a = self.take("name")
            self.take("punct", ",")
            b = self.take("name")
            self.take("punct", ")")
            return InSpan(a, b)
        if name == STICKY:
            self.take("punct", "(")
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ConditionError(f"condition nested more than {MAX_DEPTH} levels deep")
            inner = self.or_()
            self.depth -= 1
            self.take("punct", ")")
            if any(isinstance(n, Since) for n in walk(inner)):
                raise ConditionError(
                    f"in condition {self.text!r}: since(...) inside since(...); the inner "
                    f"one already holds to the end of the request"
                )
            return Since(inner)
        if name in REDUCES:
            self.take("punct", "(")
            read = self.take("name")
            self.take("punct", ")")
            cmp = self.take("cmp")
            return Latch(name, read, cmp, self.value())
        if self.peek()[0] == "cmp":
            cmp = self.take("cmp")
            return Gate(name, cmp, self.value())
        if self.peek() == ("punct", "("):
            raise ConditionError(f"in condition {self.text!r}: unknown function {name!r}")
        raise ConditionError(
            f"in condition {self.text!r}: {name!r} is not a condition; use one of "
            f"{', '.join(FLAGS)}, token_in(set), in_span(open, close), READ >= value, "
            f"prompt_mean(READ) >= value, prompt_last(READ) >= value, since(condition)"
        )


def parse(text: str) -> Node:
    if not isinstance(text, str):
        raise ConditionError(f"a condition must be a string, got {type(text).__name__}")
    return _Parser(text).parse()


def combine(expr: str | None, when: str | None, gate: str | None) -> Node | None:
    """``.cond(expr, when=, gate=)``: all given parts must hold."""
    parts = [parse(p) for p in (expr, when, gate) if p is not None]
    if not parts:
        return None
    node = parts[0]
    for p in parts[1:]:
        node = And(node, p)
    return node


def walk(node: Node, into_since: bool = True) -> Iterator[Node]:
    """Every node, parents before children (iterative: a left-deep chain of terms is as
    deep as it is long); with ``into_since=False`` a ``since(...)`` is a leaf (its condition
    is a program of its own, evaluated where it is decided)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, (And, Or)):
            stack.append(n.b)
            stack.append(n.a)
        elif isinstance(n, Not) or (isinstance(n, Since) and into_since):
            stack.append(n.a)


def sinces(node: Node | None) -> list[Since]:
    """The distinct ``since(...)`` terms of a condition, in the order they appear."""
    out: list[Since] = []
    for n in walk(node, into_since=False) if node is not None else ():
        if isinstance(n, Since) and n not in out:
            out.append(n)
    return out


def reads_named(node: Node | None) -> list[str]:
    """The reads a condition names (gates and latches, inside ``since`` too), first
    appearance first: the first is the one a monitor reports."""
    out: list[str] = []
    for n in walk(node) if node is not None else ():
        if isinstance(n, (Gate, Latch)) and n.read not in out:
            out.append(n.read)
    return out


def n_instructions(node: Node) -> int:
    """Instructions of the postfix program of ``node`` in the control block's condition
    code: one per node (a ``since(...)`` is one instruction: a test of its state)."""
    return sum(1 for _ in walk(node, into_since=False))


def to_text(node: Node) -> str:
    if isinstance(node, Flag):
        return node.name
    if isinstance(node, TokenIn):
        return f"token_in({node.set})"
    if isinstance(node, InSpan):
        return f"in_span({node.open}, {node.close})"
    if isinstance(node, Gate):
        return (
            f"{node.read} {node.cmp} {node.value!r}"
            if isinstance(node.value, float)
            else f"{node.read} {node.cmp} {node.value}"
        )
    if isinstance(node, Latch):
        v = repr(node.value) if isinstance(node.value, float) else node.value
        return f"{node.reduce}({node.read}) {node.cmp} {v}"
    if isinstance(node, Since):
        inner = to_text(node.a)
        return f"since({inner[1:-1] if isinstance(node.a, (And, Or)) else inner})"
    if isinstance(node, And):
        return f"({to_text(node.a)} and {to_text(node.b)})"
    if isinstance(node, Or):
        return f"({to_text(node.a)} or {to_text(node.b)})"
    return f"not {to_text(node.a)}"


def stack_depth(node: Node) -> int:
    """Bool-stack depth the postfix program of node needs (iterative, post-order)."""
    depth: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        n, done = stack.pop()
        if isinstance(n, (And, Or)):
            if done:
                depth[id(n)] = max(depth[id(n.a)], 1 + depth[id(n.b)])
            else:
                stack += [(n, True), (n.b, False), (n.a, False)]
        elif isinstance(n, Not):
            if done:
                depth[id(n)] = depth[id(n.a)]
            else:
                stack += [(n, True), (n.a, False)]
        else:
            depth[id(n)] = 1
    return depth[id(node)]


def read_scalar(v: Any, channel: int | None = None) -> float | None:
    """A reported read value as gates compare it, as the kernels do; None when it is not a
    scalar (capture vectors). SAE reads report {"ids", "acts"} per position: a gate on the read
    takes its first channel (a top-K read's largest activation, 0 when none is active; a
    features read's first listed feature), a gate on ``name.f<id>`` that feature's channel."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v) if channel is None else None
    if v is None:  # a non-finite value, written as null in strict JSON
        return math.nan
    if isinstance(v, dict) and isinstance(v.get("acts"), list):
        acts = v["acts"]
        i = channel or 0
        if i >= len(acts):
            return 0.0 if channel is None else None
        a = acts[i]
        return math.nan if a is None else float(a) if isinstance(a, (int, float)) else None
    return None
