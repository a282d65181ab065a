"""How long a literal a Lark or GBNF grammar makes llguidance build, read from its text before llguidance sees it.

llguidance joins a run of fixed strings into one lexeme: quoted strings side by side (`"ab" "cd"`), a rule or a
terminal that is one fixed string (`x: "ab"`, `X: /e{1000}/`), a group of them repeated an exact number of times
(`~N`, `{N}`) and the first N of a range (`~N..M`, `{N,M}`). A literal lexeme costs it about the square of its length
at every token, with none of its lexer fuel spent: `start: "a" | "b" ("e" * 1000)~20` costs 0.2 s of CPU at each
token once "b" is taken, `~99` 6 s, and the compile's probe, following the cheapest branch, never meets it. What
breaks a run, measured: an alternation of different strings (`"x" | "y"`, a character class, `\\d`, `.`), an optional
or unbounded part (`?`, `*`, `+`, `[...]` in Lark), the rest of a range. So the longest run any rule spells out is
computed here, exactly for these forms, and bounded (GrammarLimits.max_spelled); a rule that refers to itself is not
a fixed string (recursion is not inlined).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NESTING = 100  # parentheses in one rule or regex (each a level of this reader's recursion)
CAP = 1_000_000  # a run this long is refused whatever the bound: the texts compared are held to it
LARK = re.compile(r"""
    (?P<space>\s+|//[^\n]*|->\s*[A-Za-z_]\w*)  # an alias names a tree node: nothing to the lexer
  | (?P<literal>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<count>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<quant>[*+?])
  | (?P<dots>\.\.)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<open>\()
  | (?P<option>\[)
  | (?P<close>[)\]])
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
GBNF = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<literal>"(?:[^"\\\n]|\\.)*")
  | (?P<class>\[(?:[^\]\\\n]|\\.)*\]|\.)
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<quant>[*+?])
  | (?P<name>[\w-]+)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
REGEX = re.compile(r"""
    (?P<class>\[(?:[^\]\\]|\\.)*\]|\\[dDwWsSbBpPhHvV]|\.)
  | (?P<char>\\.|[^()|{}*+?\\\[^$])
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<quant>[*+?])
  | (?P<open>\((?:\?(?:[:!=]|<[!=]|P?<\w+>))?)
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
LARK_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?(?:\[[^\]\n]*\])?[ \t]*:", re.MULTILINE)
GBNF_HEAD = re.compile(r"^[ \t]*([\w-]+)[ \t]*::=", re.MULTILINE)
LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")  # llguidance's own test: else GBNF, converted to Lark
COUNT = re.compile(r"\d+")
DIRECTIVE = re.compile(r"^[ \t]*%.*$", re.MULTILINE)  # %import, %ignore, %llguidance: no rule's body
QUANTS = ("*", "+", "?")


@dataclass(frozen=True)
class Spelled:
    """What a rule, group or item spells: `fixed`, its one text where it is a fixed string (else None), and `run`, the
    longest run of fixed strings inside it, in UTF-8 bytes (its own length where it is fixed)."""

    fixed: str | None
    run: int


NOT_FIXED = Spelled(None, 0)


class Reader:
    """One grammar's rules, each read once into what it spells (memo), in an order where what a rule refers to is read
    before it (an explicit stack: a chain of a thousand rules recurses no Python frames); a rule still being read, a
    reference back to itself, counts as not fixed."""

    def __init__(self, text: str) -> None:
        lark = LARK_SYNTAX.search(text) is not None
        self.tokens, heads = (LARK, LARK_HEAD) if lark else (GBNF, GBNF_HEAD)
        text = DIRECTIVE.sub("", text)
        found = list(heads.finditer(text))
        self.bodies = {m.group(1): text[m.end():nxt.start() if nxt else len(text)]
                       for m, nxt in zip(found, [*found[1:], None])}
        self.memo: dict[str, Spelled] = {}

    def longest(self) -> int:
        """The longest run of fixed strings any rule spells out."""
        for root in self.bodies:
            if root in self.memo:
                continue
            self.memo[root] = NOT_FIXED
            stack = [(root, iter(self.references(root)))]
            while stack:
                name, refs = stack[-1]
                child = next((r for r in refs if r in self.bodies and r not in self.memo), None)
                if child is not None:
                    self.memo[child] = NOT_FIXED  # on the stack: a reference back to it is recursion
                    stack.append((child, iter(self.references(child))))
                    continue
                stack.pop()
                self.memo[name] = self.read(self.bodies[name], self.tokens, 0)
        return max((spelled.run for spelled in self.memo.values()), default=0)

    def references(self, name: str) -> list[str]:
        return [m.group() for m in self.tokens.finditer(self.bodies[name]) if m.lastgroup == "name"]

    def read(self, body: str, token: re.Pattern[str], depth: int) -> Spelled:
        tokens = [(m.lastgroup, m.group()) for m in token.finditer(body) if m.lastgroup not in ("space", "other")]
        return self.alternatives(tokens, [0], depth)

    def alternatives(self, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """The alternatives from tokens[at[0]] to the matching close (or the end); at[0] moves past them."""
        if depth > MAX_NESTING:
            raise ValueError(f"its parentheses nest over {MAX_NESTING} levels")
        alts: list[list[tuple[Spelled, str]]] = [[]]
        while at[0] < len(tokens):
            kind, value = tokens[at[0]]
            at[0] += 1
            if kind == "close":
                break
            if kind == "bar":
                alts.append([])
            elif kind in ("count", "quant", "dots"):
                if alts[-1]:
                    item, count = alts[-1][-1]
                    alts[-1][-1] = (NOT_FIXED, "") if kind == "dots" else (item, count + value)  # "a".."z": a class
            else:
                alts[-1].append((self.item(kind, value, tokens, at, depth), ""))
        return join([alternative(items) for items in alts])

    def item(self, kind: str, value: str, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """What one item spells (a group read to its close)."""
        if kind == "literal":
            text = value[1:-1] if value.endswith('"') else value[1:-2]  # "abc"i
            return Spelled(text, utf8(text))
        if kind == "char":  # a regex's character, maybe escaped
            return Spelled(value[-1], utf8(value[-1]))
        if kind == "regex":
            return self.read(value.rstrip("imslux")[1:-1], REGEX, depth + 1)
        if kind == "name":
            return self.memo.get(value, NOT_FIXED)  # read before this rule (longest's order), or not a rule
        if kind in ("open", "option"):
            inner = self.alternatives(tokens, at, depth + 1)
            return Spelled(None, inner.run) if kind == "option" else inner  # Lark's [...]: optional
        return Spelled(None, 1)  # a character class


def alternative(items: list[tuple[Spelled, str]]) -> Spelled:
    """One alternative: its runs of fixed strings summed (an exact count repeats a fixed item inside the run, a
    range's first N end it, anything not fixed or optional ends it); fixed where every item is, counted exactly."""
    run, best, text = 0, 0, ""
    for spelled, count in items:
        numbers = [int(n) for n in COUNT.findall(count)]
        if spelled.fixed is None or count.startswith(QUANTS) or count.endswith(QUANTS):
            best, run, text = max(best, run, spelled.run), 0, None
            continue
        times = min(numbers) if numbers else 1  # an exact count, or a range's least
        run = min(run + utf8(spelled.fixed) * times, CAP)
        if exact(count):
            text = repeated(text, spelled.fixed, times)
        else:  # a range: its first `times` are joined, the rest ends the run
            best, run, text = max(best, run), 0, None
    return Spelled(text, max(best, run))


def utf8(text: str) -> int:
    """A text's length in UTF-8 bytes, the unit llguidance's lexer reads (a 4-byte character costs four)."""
    return len(text.encode("utf-8", "surrogatepass"))


def exact(count: str) -> bool:
    """Whether a count (Lark's ~N or ~N..M, GBNF's or a regex's {N}, {N,M} or {N,}) is one number of times."""
    numbers = COUNT.findall(count)
    return not numbers or len(set(numbers)) == 1 and (len(numbers) == 2 or not re.search(r"\.\.|,", count))


def repeated(text: str | None, fixed: str, times: int) -> str | None:
    """text + fixed * times, or None where either is past CAP (the run's length is what is bounded)."""
    if text is None or len(text) + len(fixed) * times > CAP:
        return None
    return text + fixed * times


def join(alts: list[Spelled]) -> Spelled:
    """Alternatives together: a fixed string only where every one is the same fixed string."""
    texts = {a.fixed for a in alts}
    fixed = alts[0].fixed if len(texts) == 1 else None
    return Spelled(fixed, max(a.run for a in alts))


def longest_literal(text: str) -> int:
    """The longest literal lexeme (a run of fixed strings) the grammar makes llguidance build, in UTF-8 bytes; ValueError
    where its parentheses nest over MAX_NESTING levels."""
    return Reader(text).longest()


def regex_length(pattern: str) -> int:
    """The longest run of fixed text in a regex (`e{1000}` a thousand; a class, `*` or `|` ends a run); ValueError
    where its parentheses nest over MAX_NESTING levels."""
    return Reader("").read(pattern, REGEX, 0).run
