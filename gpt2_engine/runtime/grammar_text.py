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

from .grammar_worker import LARK_SYNTAX

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
    (?P<space>\(\?[a-zA-Z-]+\))  # inline flags: (?x), (?i)
  | (?P<class>\[(?:[^\]\\]|\\.)*\]|\\[pP](?:\{[^}]*\}|\w)|\\[dDwWsSbBhHvV]|\.)
  | (?P<char>\\[xu]\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\U[0-9a-fA-F]{8}|\\.|[^()|{}*+?\\\[^$])
  | (?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})
  | (?P<quant>[*+?])
  | (?P<open>\((?:\?(?:[:!=]|<[!=]|P?<\w+>|[a-zA-Z-]+:))?)
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
ATTRIBUTES = r'(?:[ \t]*\[(?:[^\]"\n]|"(?:[^"\\\n]|\\.)*")*\])?'  # llguidance's [capture], [stop="]"], [lazy]
LARK_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:[ \t]*\.-?\d+)?" + ATTRIBUTES + r"[ \t]*:", re.MULTILINE)
GBNF_HEAD = re.compile(r"^[ \t]*([\w-]+)[ \t]*::=", re.MULTILINE)
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
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # llguidance ends a line at either
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
        if token is REGEX and VERBOSE.search(body):
            body = unverbose(body)
        tokens = [(m.lastgroup, m.group()) for m in token.finditer(body) if m.lastgroup not in ("space", "other")]
        return self.alternatives(tokens, [0], depth)

    def alternatives(self, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """The alternatives from tokens[at[0]] to the matching close (or the end); at[0] moves past them."""
        if depth > MAX_NESTING:
            raise ValueError(f"its parentheses nest over {MAX_NESTING} levels")
        alts: list[list[tuple[Spelled, tuple[str, ...]]]] = [[]]
        while at[0] < len(tokens):
            kind, value = tokens[at[0]]
            at[0] += 1
            if kind == "close":
                break
            if kind == "bar":
                alts.append([])
            elif kind in ("count", "quant", "dots"):
                if alts[-1]:
                    alts[-1][-1] = self.counted(alts[-1][-1], kind, value, tokens, at)
            else:
                alts[-1].append((self.item(kind, value, tokens, at, depth), ()))
        return join([alternative(items) for items in alts])

    def counted(self, last: tuple[Spelled, tuple[str, ...]], kind: str, value: str, tokens: list[tuple[str, str]],
                at: list[int]) -> tuple[Spelled, tuple[str, ...]]:
        """The last item with a count or quantifier added (a `?` after one is lazy: the same text), or a Lark range
        in its place (`"e".."e"` is the one character)."""
        item, counts = last
        if kind == "dots":
            end = tokens[at[0]][1] if at[0] < len(tokens) and tokens[at[0]][0] == "literal" else None
            at[0] += end is not None
            same = end is not None and item.fixed is not None and end[1:-1] == item.fixed and len(item.fixed) == 1
            return (item if same else Spelled(None, 1), counts)
        if value == "?" and counts:  # lazy
            return last
        return item, (*counts, value)

    def item(self, kind: str, value: str, tokens: list[tuple[str, str]], at: list[int], depth: int) -> Spelled:
        """What one item spells (a group read to its close)."""
        if kind == "literal":
            text = value[1:-1] if value.endswith('"') else value[1:-2]  # "abc"i
            return Spelled(text, utf8(text))
        if kind == "char":  # a regex's character, maybe escaped
            char = unescape(value)
            return Spelled(char, utf8(char))
        if kind == "regex":
            body, flags = value[1:value.rindex("/")], value[value.rindex("/") + 1:]
            return self.read(unverbose(body) if "x" in flags else body, REGEX, depth + 1)
        if kind == "name":
            return self.memo.get(value, NOT_FIXED)  # read before this rule (longest's order), or not a rule
        if kind in ("open", "option"):
            inner = self.alternatives(tokens, at, depth + 1)
            return Spelled(None, inner.run) if kind == "option" else inner  # Lark's [...]: optional
        char = one_character(value)
        return Spelled(char, utf8(char)) if char is not None else Spelled(None, 1)  # a class


def alternative(items: list[tuple[Spelled, tuple[str, ...]]]) -> Spelled:
    """One alternative: its runs of fixed strings summed (exact counts repeat a fixed item inside the run, a range's
    first N end it, anything not fixed or optional ends it); fixed where every item is, counted exactly."""
    run, best, text = 0, 0, ""
    for spelled, counts in items:
        if spelled.fixed is None or any(c in QUANTS for c in counts):
            best, run, text = max(best, run, spelled.run), 0, None
            continue
        times, exact = 1, True
        for count in counts:  # e{1000}{1}: each count repeats what the one before made
            numbers = [int(n) for n in COUNT.findall(count)]
            times = min(times * min(numbers), CAP)
            exact = exact and is_exact(count)
        run = min(run + utf8(spelled.fixed) * times, CAP)
        if exact:
            text = repeated(text, spelled.fixed, times)
        else:  # a range: its first `times` are joined, the rest ends the run
            best, run, text = max(best, run), 0, None
    return Spelled(text, max(best, run))


def is_exact(count: str) -> bool:
    """Whether a count (Lark's ~N or ~N..M, GBNF's or a regex's {N}, {N,M} or {N,}) is one number of times."""
    numbers = COUNT.findall(count)
    return len(set(numbers)) == 1 and (len(numbers) == 2 or not re.search(r"\.\.|,", count))


def one_character(token: str) -> str | None:
    """The one character a class matches, where it matches one (`[e]`, `[e-e]`, `[\\x65]`): llguidance makes it a
    literal; else None."""
    body = token[1:-1] if token.startswith("[") and token.endswith("]") and len(token) > 2 else None
    if body is None or body.startswith("^"):
        return None
    if m := re.fullmatch(r"(\\[xu]\{[0-9a-fA-F]+\}|\\x[0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}|\\.|[^\\])(?:-\1)?", body):
        return unescape(m.group(1))
    return None


def unescape(char: str) -> str:
    """A regex's or class's one character, its escape read (`\\x65`, `\\u{65}`: e)."""
    if m := re.fullmatch(r"\\[xuU]\{?([0-9a-fA-F]+)\}?", char):
        code = int(m.group(1), 16)
        return chr(code) if code < 0x110000 else "\ufffd"
    return char[-1]


VERBOSE = re.compile(r"\(\?[a-wyz]*x")  # (?x) or (?ix): whitespace and # comments are not the regex's
def unverbose(body: str) -> str:
    """A verbose regex without its whitespace and comments (escapes and classes kept)."""
    return re.sub(r"(\\.|\[(?:[^\]\\]|\\.)*\])|\s+|#[^\n]*", lambda m: m.group(1) or "", body)


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
