"""A GPU call's working tree, checked against the commit it claims: every file of `git ls-files -s` (the manifest
written before the call) hashed as git hashes a blob. Prints the files that differ; exit 1 if any do.

    git ls-files -s fitune bench > .gpu_manifest   # before the call, on the CPU machine
    python3 bench/calls/revert_check.py .gpu_manifest    # on the GPU machine, in the copied tree
"""

import hashlib
import sys


def blob_sha1(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def main(manifest: str) -> int:
    differ = []
    with open(manifest, encoding="utf-8") as f:
        for line in f:
            meta, path = line.rstrip("\n").split("\t", 1)
            try:
                if blob_sha1(path) != meta.split()[1]:
                    differ.append(path)
            except OSError:
                differ.append(path)
    print(f"tree check: {len(differ)} file(s) differ from the commit" + (": " + " ".join(differ) if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
