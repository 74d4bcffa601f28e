"""Print the shell lines of the code blocks in README.md's "## Install" section, for .ci/run to run as written."""
import sys


def install_lines(readme: str) -> list[str]:
  section = readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
  blocks = section.split("```")[1::2]   # the text between each pair of fences
  lines = [line.split("  #", 1)[0].strip() for block in blocks for line in block.splitlines()]
  lines = [line for line in lines if line]
  if not lines:
    sys.exit(f"error: {sys.argv[1]}: no install lines under '## Install'")
  return lines


if __name__ == "__main__":
  with open(sys.argv[1], encoding="utf-8") as f:
    print("\n".join(install_lines(f.read())))
