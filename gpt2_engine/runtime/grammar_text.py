"""How long a literal a Lark or GBNF grammar can make, read from its text before llguidance sees it.

llguidance joins what a rule spells out with literals alone (`"ab" "cd"`, a rule that is one literal, a group repeated
`~N` or `{N}` times) into one lexeme, and a literal lexeme costs it about the square of its length at every token,
with none of its lexer fuel spent: `start: "a" | "b" ("e" * 1000)~20` costs 0.2 s of CPU at each token once "b" is
taken, `~99` 6 s. The compile's probe follows the cheapest branch and cannot see it. So the longest literal text any
one alternative can spell out is bounded here: an upper bound, reading every literal and /regex/ body as literal text
(a regex as its longest match, `/e{1000}/` a thousand: llguidance makes a fixed string of a regex a literal too, and
ninety-nine of those side by side cost 5 s a step), a reference to a rule as that rule's longest, and a repetition by
its largest count (`*`, `+`, `?` and unbounded counts once, as llguidance does not inline them). A rule that refers
to itself counts its own references as empty (recursion is not inlined either).
"""

from __future__ import annotations

import re

MAX_NESTING = 100  # parentheses in one rule (each a level of this reader's recursion)
TOKENS = r"""
    (?P<space>\s+|//[^\n]*|\#[^\n]*)
  | (?P<literal>"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*%s)
  | (?P<counted>~\s*\d+(?:\s*\.\.\s*\d+)?|\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<name>[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<bar>\|)
  | (?P<other>.)
"""
LARK = re.compile(TOKENS % "", re.VERBOSE | re.DOTALL)
GBNF = re.compile(TOKENS % r"|\[(?:[^\]\\\n]|\\.)*\]", re.VERBOSE | re.DOTALL)  # a character class: one character
REGEX = re.compile(r"""
    (?P<literal>\\.|\[(?:[^\]\\]|\\.)*\]|[^()|{}*+?\\\[^$])  # one character: escaped, a class, or plain
  | (?P<counted>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)  # a /regex/ body: llguidance makes a fixed string of one (`/e{1000}/`) a literal too
HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(?:::=|:)", re.MULTILINE)
COUNT = re.compile(r"\d+")
LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")  # llguidance's own test: else GBNF, converted to Lark


def longest_literal(text: str) -> int:
    """An upper bound on the characters of literal text one lexeme of the grammar can hold (see the module's doc);
    ValueError where its parentheses nest over MAX_NESTING levels."""
    heads = list(HEAD.finditer(text))
    bodies = {m.group(1): text[m.end():nxt.start() if nxt else len(text)]
              for m, nxt in zip(heads, [*heads[1:], None])}
    tokens = LARK if LARK_SYNTAX.search(text) else GBNF
    parsed = {name: parse(body, tokens) for name, body in bodies.items()}
    memo: dict[str, int] = {}
    return max((rule_length(name, parsed, memo) for name in parsed), default=0)


def regex_length(pattern: str) -> int:
    """An upper bound on the characters one match of `pattern` spells out (`*`, `+` and `?` once, counts expanded);
    ValueError where its parentheses nest over MAX_NESTING levels."""
    return node_length(parse(pattern, REGEX), {})


def parse(body: str, token: re.Pattern[str], depth: int = 0) -> list:
    """A rule's body (or a regex's) as nested lists: ["|", [alternative...]...] where an alternative is a list of
    items, each (kind, value, count): ("literal", length, n), ("name", rule, n) or ("group", ["|", ...], n)."""
    tokens = [(m.lastgroup, m.group()) for m in token.finditer(body) if m.lastgroup not in ("space", "other")]
    return alternatives(tokens, 0, depth)[0]


def alternatives(tokens: list[tuple[str, str]], at: int, depth: int) -> tuple[list, int]:
    """The alternatives from tokens[at] to the matching close (or the end), and where they stop."""
    if depth > MAX_NESTING:
        raise ValueError(f"its parentheses nest over {MAX_NESTING} levels")
    alts: list[list] = [[]]
    while at < len(tokens):
        kind, value = tokens[at]
        at += 1
        if kind == "close":
            break
        if kind == "bar":
            alts.append([])
        elif kind == "counted" and alts[-1]:
            item = alts[-1][-1]
            alts[-1][-1] = (item[0], item[1], item[2] * max(map(int, COUNT.findall(value))))
        elif kind == "literal":
            alts[-1].append(("literal", literal_length(value, depth + 1) if len(value) > 1 else 1, 1))  # 1: a regex's
        elif kind == "name":
            alts[-1].append(("name", value.lstrip("?!").split(".")[0], 1))
        elif kind == "open":
            group, at = alternatives(tokens, at, depth + 1)
            alts[-1].append(("group", group, 1))
    return ["|", *alts], at


def literal_length(token: str, depth: int = 0) -> int:
    """The characters a quoted string spells (escapes counted as written: an upper bound), a /regex/ body at most
    (its counted repetitions expanded, `*`, `+` and `?` once), a character class one."""
    if token.startswith(("[", "\\")):  # a class, or a regex's escaped character
        return 1
    if token.startswith("/"):
        return node_length(parse(token.rstrip("imslux")[1:-1], REGEX, depth), {})  # regex_length, one level down
    return len(token.rstrip("imslux")) - 2


def rule_length(name: str, parsed: dict[str, list], memo: dict[str, int]) -> int:
    """The longest literal text rule `name` spells out; rules are evaluated in dependency order with an explicit
    stack (a chain of a thousand rules must not recurse a thousand Python frames), a rule on the stack counting 0."""
    if name in memo:
        return memo[name]
    stack, active = [name], {name}
    while stack:
        top = stack[-1]
        missing = [r for r in references(parsed.get(top, ["|"])) if r in parsed and r not in memo and r not in active]
        if missing:
            stack.append(missing[0])
            active.add(missing[0])
            continue
        memo[top] = node_length(parsed.get(top, ["|"]), memo)
        stack.pop()
        active.discard(top)
    return memo[name]


def references(node: list) -> set[str]:
    """The rule names a parsed body refers to, at any depth."""
    found, todo = set(), [node]
    while todo:
        for alt in todo.pop()[1:]:
            for kind, value, _ in alt:
                if kind == "name":
                    found.add(value)
                elif kind == "group":
                    todo.append(value)
    return found


def node_length(node: list, memo: dict[str, int]) -> int:
    """The longest alternative of a parsed node: items summed, each times its count (a rule not yet known counts 0)."""
    def item(kind: str, value: object, count: int) -> int:
        if kind == "literal":
            return int(value) * count
        if kind == "name":
            return memo.get(str(value), 0) * count
        return node_length(value, memo) * count  # type: ignore[arg-type]

    return max((sum(item(*it) for it in alt) for alt in node[1:]), default=0)
