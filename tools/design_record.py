"""Write the lab's design record (docs/results/lab-design-<machine>.md) from the packaged design:
each arm's pilot losses and learning rate, and each preset's seed count with its power
calculation. Run after committing a new `normlab compare ... --tune` design.json:

    python tools/design_record.py epyc
"""

import sys
from pathlib import Path

from normlab.experiments import design as DS

ROOT = Path(__file__).resolve().parents[1]

INTRO = """# The lab's design: tuned learning rates and seed counts (quick sizes)

The presets read `src/normlab/experiments/design.json`, made by the pilot below before any test
run of this design (the pilot's seeds, 100-102, are never test seeds). How it decides is in
`src/normlab/experiments/design.py`:

- each arm (one setting a preset compares) trains at the preset's learning rate and a factor 3
  either side, and up to two more steps past an edge of the grid that held the best; its
  learning rate is the one of lowest mean validation loss over the pilot seeds ("-": a pilot
  seed diverged);
- each equivalence claim gets the fewest seeds (3 to 10) that give 80% power to decide it at its
  margin, by two one-sided t tests on the paired log ratios, true gap 0, at the family-wise level
  0.05 / K (K: the sampled tests of the invocation it is planned for: the demo's for the demo's
  presets, `compare all`'s for the rest). The spread is the pilot's, on 2 degrees of freedom, so
  the power is an estimate; the records say where the seeds fell short.

"""


def main() -> None:
    machine = sys.argv[1] if len(sys.argv) > 1 else "epyc"
    design = DS.load()
    body = INTRO + DS.markdown(design, "quick") + "\n"
    path = ROOT / "docs" / "results" / f"lab-design-{machine}.md"
    path.write_text(body)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
