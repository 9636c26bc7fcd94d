"""Which files under bench/results/ the docs cite; prints the ones nothing cites (candidates to git rm)."""
import fnmatch, re, subprocess, sys
from pathlib import Path
SOURCES = ["README.md", "bench/results/README.md", "bench/results/default_model.md",
           "bench/results/default_model_h200/README.md", "notebooks/README.md"] + \
          [str(p) for p in Path("docs").glob("*.md")] + [str(p) for p in Path("tests").glob("*.py")] + [str(p) for p in Path("bench").rglob("*.py")] + [str(p) for p in Path("bench/scripts").glob("*.sh")] + [str(p) for p in Path("notebooks").glob("*.py")] + [str(p) for p in Path("jaxspec").rglob("*.sh")]
files = subprocess.run(["git", "ls-files", "bench/results"], capture_output=True, text=True).stdout.split()
text = "\n".join(Path(s).read_text() for s in SOURCES if Path(s).exists())
tokens = set(re.findall(r"[A-Za-z0-9_.{},*/\-]+", text))
# short suffix citations (`-0114`, `-1749-xla-attention.md`): join each to the nearest full stem before it
STEM = re.compile(r"([a-z0-9\-]+-gpu-\d{8}-)\d{4}")
for m in re.finditer(r"`(-\d{4}[A-Za-z0-9_.\-]*)`", text):
    before = list(STEM.finditer(text, max(0, m.start() - 600), m.start()))
    if before: tokens.add(before[-1].group(1) + m.group(1)[1:])
def expand(tok):  # {a,b} alternatives
    m = re.search(r"\{([^{}]*)\}", tok)
    if not m: return [tok]
    return [x for alt in m.group(1).split(",") for x in expand(tok[:m.start()] + alt + tok[m.end():])]
pats = {e.rstrip(".,;:") for t in tokens for e in expand(t)}
KEEP_DIRS = ("run14/", "run15/", "run16/", "run17/", "run18/", "run19/", "run20/", "run21/", "run22/", "run23/",
             "default_model/", "default_model_h200/")
def cited(f):
    rel = f[len("bench/results/"):]
    if rel == "README.md" or rel.startswith(KEEP_DIRS): return "dir"
    name = rel.rsplit("/", 1)[-1]; stem = name.split(".")[0]
    for p in pats:
        p2 = p[len("bench/results/"):] if p.startswith("bench/results/") else p
        if p2 in (rel, name, stem) or re.sub(r"\.(md|json|log|txt)$", "", p2) in (stem, rel.rsplit(".", 1)[0]) or (("*" in p2 or "?" in p2) and re.search(r"\d{4}", p2) and (fnmatch.fnmatch(rel, p2) or fnmatch.fnmatch(name, p2))):
            return "cited"
        if len(p2) > 3 and p2.endswith("/") and rel.startswith(p2): return "cited dir"
    m = re.search(r"(\d{8})-(\d{4})", name)  # files of runs 14-23 (2026-11-30 07:53 on), cited by the raw log's short forms
    if m and (m.group(1), m.group(2)) >= ("20261130", "0753"): return "kept run"
    return None
keep = {f: cited(f) for f in files}
drop = [f for f, why in keep.items() if not why]
print(f"{len(files)} files, keep {len(files) - len(drop)}, drop {len(drop)}", file=sys.stderr)
print("\n".join(drop))
