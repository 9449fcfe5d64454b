"""Finding the images in a folder, the one scanner of pack, folder training and classify.

Only regular files with an image extension are taken. Symlinks are followed, but each real
file is taken once and each real folder walked once (both keyed by (st_dev, st_ino)), so a link
loop (`ln -s . cat/loop`) or a second link to the same photo adds nothing, and a file or folder
is taken as itself before any link to it (a link never moves an image to another class).
Everything passed over is listed with the reason (hidden names, other file types, FIFOs and
devices, broken links, duplicates), never dropped silently. A class folder with no images is refused: a silently empty
class would change the number of outputs of the network; one that cannot be read is refused
too (its images would be lost, not skipped).
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

from cnnkit.data.decode import file_kind, is_image_name
from cnnkit.errors import DataError, plural, suggest

FileKey = tuple[int, int]  # (st_dev, st_ino): one real file or folder
Found = tuple[str, FileKey, bool]  # (path under the root, key, is a link)
REPORTED_LINES = 10  # skipped entries named one per line on stderr; the rest are counted
SPLIT_NAMES = {"train", "training", "val", "valid", "validation", "test", "testing"}
ALREADY_SCANNED = "a folder already scanned (a symlink loop, a second link or another class)"


@dataclass
class Scan:
    """What a folder holds: image paths relative to the root (in a fixed order), their labels,
    the class names, the (relative path, reason) of everything passed over, every real
    folder walked (key -> its path under the root: a folder reached through a link is there)
    and every real file taken (key -> its path)."""

    files: list[str]
    labels: list[int]
    classes: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    folders: dict[FileKey, str] = field(default_factory=dict)
    taken: dict[FileKey, str] = field(default_factory=dict)  # real file -> its path in files


def printable(text: str) -> str:
    """A path as it can go on one line of a message or report: tabs and line breaks escaped,
    undecodable bytes of a file name written as \\xNN."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.translate({9: "\\t", 10: "\\n", 13: "\\r"})


def skip_reason(name: str) -> str:
    """Why a regular file of this name is not taken as an image."""
    if name.startswith("."):
        return "hidden file"
    suffix = os.path.splitext(name)[1]
    return f"not a supported image type ({suffix.lower() or 'no extension'})"


class Walker:
    """Takes image files under one root: each real file once, each real folder walked once."""

    def __init__(self, root: Path, taken: dict[FileKey, str] | None = None):
        self.root = root
        self.folders: dict[FileKey, str] = {}  # real folder walked -> its path under the root
        self.taken = {} if taken is None else taken  # real file -> the path it was taken as
        self.skipped: list[tuple[str, str]] = []
        self.unreadable: dict[str, OSError] = {}  # folders that could not be listed

    def claim_folder(self, path: Path) -> FileKey | None:
        """Mark a folder as walked; its key, or None if it was walked already."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in self.folders:
            return None
        self.folders[key] = os.path.relpath(path, self.root)
        return key

    def entry(self, entry: os.DirEntry, rel: str, device: int) -> tuple[str, FileKey] | None:
        """('file' | 'folder', key) of one directory entry worth taking, else listed as skipped."""
        try:
            if not entry.is_symlink() and entry.is_file(follow_symlinks=False):
                # no stat call (d_type and d_ino from the listing): a plain file lies on its
                # folder's device (only a bind-mounted single file would not)
                kind, key = stat.S_IFREG, (device, entry.inode())
            else:
                st = entry.stat()  # follows the link
                kind, key = stat.S_IFMT(st.st_mode), (st.st_dev, st.st_ino)
        except OSError as e:
            broken = entry.is_symlink() and not os.path.exists(entry.path)
            self.skipped.append((rel, "broken symlink" if broken else f"unreadable ({e.strerror})"))
            return None
        if entry.name.startswith("."):
            self.skipped.append((rel, "hidden folder" if kind == stat.S_IFDIR else "hidden file"))
        elif kind == stat.S_IFDIR:
            return "folder", key
        elif kind != stat.S_IFREG:
            self.skipped.append((rel, f"not a regular file ({file_kind(kind)})"))
        elif not is_image_name(entry.name):
            self.skipped.append((rel, skip_reason(entry.name)))
        else:
            return "file", key
        return None

    def listing(self, rel: str) -> tuple[list[Found], list[Found]]:
        """The image files and the subfolders right inside folder `rel`, each as (path, key,
        is a link); the subfolders are not claimed yet."""
        where = self.root / rel
        try:
            device = os.stat(where).st_dev
            entries = sorted(os.scandir(where), key=lambda e: e.name)
        except OSError as e:
            self.skipped.append((rel, f"unreadable folder ({e.strerror})"))
            self.unreadable[rel] = e
            return [], []
        files, folders = [], []
        for entry in entries:
            path = os.path.join(rel, entry.name)
            found = self.entry(entry, path, device)
            if found is not None:
                kind, key = found
                (files if kind == "file" else folders).append((path, key, entry.is_symlink()))
        return files, folders

    def images(self, rel: str, recursive: bool = True) -> list[str]:
        """Image files under folder `rel` not taken before, sorted by (folder, name)."""
        return self.take(self.found([rel], recursive))[0]

    def found(self, roots: list[str], recursive: bool = True) -> list[list[Found]]:
        """(path, key, is a link) of every image file under each folder of `roots` (one list
        per root, sorted by (folder, name)); nothing taken yet. Every folder reached without a
        folder link is walked before any link is followed, so a link (even from another
        class's folder) never claims a real folder from the class it lies in."""
        groups: list[list[Found]] = [[] for _ in roots]
        real = list(enumerate(roots))[::-1]  # a stack: the first root first
        links: list[tuple[int, str, FileKey]] = []
        while real or links:
            if real:
                k, rel = real.pop()
            else:
                k, rel, key = links.pop(0)
                if key in self.folders:
                    self.skipped.append((rel, ALREADY_SCANNED))
                    continue
                self.folders[key] = rel
            files, folders = self.listing(rel)
            groups[k] += files
            for path, key, is_link in folders:
                if not recursive:
                    self.skipped.append((path, "a folder (a flat folder is not searched below)"))
                elif key in self.folders:
                    self.skipped.append((path, ALREADY_SCANNED))
                elif is_link:
                    links.append((k, path, key))
                else:
                    self.folders[key] = path
                    real.append((k, path))
        for found in groups:
            found.sort(key=lambda item: (os.path.dirname(item[0]), os.path.basename(item[0])))
        return groups

    def take(self, groups: list[list[Found]]) -> list[list[str]]:
        """The paths each group (a class) takes: each real file once, as the file itself
        rather than a link to it, wherever the link lies (a link in another class folder
        loses to the real file, which keeps its own label); the rest listed as skipped."""
        first: dict[FileKey, str] = {}  # real file -> the path it is taken as
        for path, key, _ in sorted(chain(*groups), key=lambda item: item[2]):  # stable: links last
            first.setdefault(key, path)
        kept = []
        for group in groups:
            kept.append([])
            for path, key, _ in group:
                if key in self.taken or first[key] != path:
                    taken = self.taken.get(key, first[key])
                    self.skipped.append((path, f"the same file as {printable(taken)}"))
                else:
                    self.taken[key] = path
                    kept[-1].append(path)
        return kept


def class_folders(src: Path, classes: list[str] | None, skip_empty: bool = False,
                  labels_option: str | None = None) -> Scan:  # fmt: skip
    """Images of an ImageFolder tree: one subfolder per class (links followed, loops not).
    A class folder without images is refused (training: it would change the network's
    outputs), or with `skip_empty` (evaluation, which matches classes by name) skipped.
    `labels_option`: how the command takes a flat folder's label file, said where the folder
    has no subfolders (None: it takes none)."""
    walker = Walker(src)
    walker.claim_folder(src)
    names = []
    try:
        entries = sorted(os.scandir(src), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f"{printable(str(src))}: unreadable folder ({e.strerror})") from None
    for entry in entries:
        found = walker.entry(entry, entry.name, os.stat(src).st_dev)
        if found is not None and found[0] == "file":
            walker.skipped.append((entry.name, "outside the class folders"))
        elif found is not None:
            if walker.claim_folder(src / entry.name) is None:
                raise DataError(f"{printable(str(src / entry.name))}: a link to a folder that "
                                "is already a class (or the data folder itself)")  # fmt: skip
            names.append(entry.name)
    if not names:
        raise DataError(f"{printable(str(src))}: no class subfolders ({flat_hint(labels_option)})")
    if classes is None and len(names) > 1 and all(n.lower() in SPLIT_NAMES for n in names):
        train = next((n for n in names if n.lower() in ("train", "training")), None)
        which = (
            f"({printable(str(src / train))})"
            if train
            else f"(e.g. {printable(str(src / names[0]))})"
        )
        raise DataError(f"{printable(str(src))}: its subfolders {', '.join(names)} are a data "
                        f"set's splits, not classes; give the split's own folder {which}, "
                        "whose subfolders are the classes")  # fmt: skip
    files, labels, kept = [], [], []
    taken = walker.take(walker.found(names))
    unreadable = next((name for name in names if name in walker.unreadable), None)
    if unreadable is not None:  # never an empty class, nor skipped: its images would be lost
        raise DataError(_unreadable_class(src, unreadable, walker.unreadable[unreadable]))
    for name, found in zip(names, taken, strict=True):
        if not found and classes is None:
            if not skip_empty:
                raise DataError(_empty_class(src, name, walker.skipped))
            walker.skipped.append((name, EMPTY_SKIPPED))
            continue
        files += found
        labels += [len(kept)] * len(found)
        kept.append(name)
    if not files:
        raise DataError(f"{printable(str(src))}: no images in the class subfolders")
    return Scan(files, labels, kept, walker.skipped, walker.folders, walker.taken)


def flat_hint(labels_option: str | None) -> str:
    """What to do with a folder of images and no class subfolders: give its label file the way
    the command takes one (`--labels`, `data.val_labels`), or, where it takes none, the tree
    it reads (or a pack, which keeps a flat folder's labels)."""
    if labels_option is None:
        return (
            "an ImageFolder tree is read here: one subfolder per class; a flat folder "
            "and its label file can be packed first: cnnkit pack SRC DST --labels FILE"
        )
    give = f"give {labels_option} FILE" if labels_option.startswith("-") else f"set {labels_option}"
    return f"a flat folder needs a label file: {give}"


EMPTY_SKIPPED = (
    "class folder with no images (classes are matched to the network's by name, "
    "so it changes no output)"
)  # evaluation's reason, said on stderr


def _empty_class(src: Path, name: str, skipped: list[tuple[str, str]]) -> str:
    inside = [(p, r) for p, r in skipped if p.startswith(name + os.sep)]
    what = f" ({len(inside)} other {'entries' if len(inside) != 1 else 'entry'} skipped, " \
        f"first {printable(inside[0][0])}: " \
        f"{inside[0][1]})" if inside else ""  # fmt: skip
    return (f"{printable(str(src / name))}: class folder with no images{what}; add images or "
            "remove it (an empty class changes the network's outputs)")  # fmt: skip


def _unreadable_class(src: Path, name: str, error: OSError) -> str:
    denied = isinstance(error, PermissionError)
    fix = "give this user read access to it" if denied else "check the folder and its disk"
    return (f"{printable(str(src / name))}: class folder cannot be read ({error.strerror}); "
            f"{fix}, or move it out of {printable(str(src))}")  # fmt: skip


def read_label_file(path: Path, labels_option: str | None = None) -> dict[str, str]:
    """File name (or stem) -> class name, from `NAME CLASS` lines (the class is the last word,
    so names may hold spaces, and commas) or, in a .csv file or one with Kaggle's `ImageId,`
    header, `NAME,CLASS ...` rows (LOC_val_solution.csv: the first word of the second column is
    the class). A name given two different classes is an error; a UTF-8 byte-order mark is
    allowed. `labels_option`: the option or setting that named the file, said if it is not
    there."""
    if not path.is_file():
        where = f"{labels_option} {path}" if labels_option else str(path)
        what = "a folder, not a label file" if path.is_dir() else "label file not found"
        raise DataError(f"{printable(where)}: {what}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not a UTF-8 text file (byte {e.start}); a label file holds "
                        "'FILENAME CLASS' lines") from None  # fmt: skip
    mapping: dict[str, str] = {}
    lines: dict[str, int] = {}
    csv = path.suffix.lower() == ".csv" or text.lstrip().startswith("ImageId,")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("ImageId,"):
            continue
        if csv:
            name, _, rest = line.partition(",")
            label = rest.split()[0] if rest.split() else ""
        else:
            words = line.rsplit(None, 1)
            name, label = (words[0], words[1]) if len(words) == 2 else (line, "")
        name = name.strip()
        if not name or not label:
            raise DataError(f"{path}:{number}: expected 'FILENAME CLASS', got {line.strip()!r}")
        if mapping.get(name, label) != label:
            raise DataError(f"{path}:{number}: {name!r} is labelled {label!r} here but "
                            f"{mapping[name]!r} on line {lines[name]}")  # fmt: skip
        mapping[name], lines[name] = label, lines.get(name, number)
    return mapping


def flat_with_labels(src: Path, labels_file: Path,
                     labels_option: str | None = None,
                     ) -> tuple[list[str], list[str], Scan]:  # fmt: skip
    """(files, class names) of the images right inside a flat folder (not below it), labelled
    by a label file; the Scan says what was skipped, and names the label file's entries with
    no image in the folder (a half-copied validation set says so)."""
    mapping = read_label_file(labels_file, labels_option)
    walker = Walker(src)
    walker.claim_folder(src)
    files = walker.images("", recursive=False)
    missing = [n for n in files if n not in mapping and Path(n).stem not in mapping]
    if missing:
        raise DataError(f"{labels_file}: no label for {plural(len(missing), 'image')} in {src} "
                        f"(first: {printable(missing[0])})")  # fmt: skip
    names = [mapping.get(n, mapping.get(Path(n).stem)) for n in files]
    found = {key for n in files for key in (n, Path(n).stem)}
    absent = [(n, f"named in {labels_file.name} but not in the folder") for n in mapping
              if n not in found]  # fmt: skip
    return files, names, Scan(files, [], [], walker.skipped + absent, walker.folders, walker.taken)


def scan_images(src: str | Path, labels_file: str | Path | None = None,
                classes: list[str] | None = None, skip_empty: bool = False,
                labels_option: str | None = None) -> Scan:  # fmt: skip
    """The images of an ImageFolder tree, or of a flat folder + label file, and what was skipped.

    With `classes` given (e.g. the training set's), labels index into that list and class
    folders without images are allowed (the classes are fixed already); `skip_empty` leaves
    them out of the classes found (evaluation), instead of refusing them (training).
    `labels_option`: the option or setting that gives the label file (`--labels`,
    `data.val_labels`), named in messages; None where the command takes none.
    """
    src = Path(src)
    if not src.is_dir():
        raise DataError(f"{printable(str(src))}: not a folder")
    if labels_file is not None:
        files, names, scan = flat_with_labels(src, Path(labels_file), labels_option)
        found = sorted(set(names))
        if not files:
            nested = any(p.is_dir() for p in src.iterdir())
            why = (" at its top (a label file goes with a flat folder; class subfolders, as "
                   "here, need none)" if nested else "")  # fmt: skip
            raise DataError(f"{printable(str(src))}: no image files found{why}")
    else:
        scan = class_folders(src, classes, skip_empty, labels_option)
        files, found = scan.files, scan.classes
        names = [found[k] for k in scan.labels]
    classes = classes or found
    lookup = {name: k for k, name in enumerate(classes)}
    unknown = sorted(set(names) - set(lookup))
    if unknown:
        raise DataError(f"{src}: class {unknown[0]!r} is not among the training classes"
                        f"{unknown_classes(unknown, classes)}")  # fmt: skip
    return Scan(files, [lookup[n] for n in names], classes, scan.skipped, scan.folders, scan.taken)


def unknown_classes(unknown: list[str], classes: list[str], indexed: bool = True) -> str:
    """` (...)` for classes not among `classes` (the network's): where every one is a number
    and the classes are names, that the set names classes by index (Caffe's val.txt:
    `VAL_00000001.JPEG 0`), not by name, where it may (`indexed`: a label file's set, not a
    bundled one's own names); else the near match, else the classes there are."""
    shown = ", ".join(repr(c) for c in classes[:8]) + (", ..." if len(classes) > 8 else "")
    numbers = all(map(str.isdecimal, unknown)) and not all(map(str.isdecimal, classes))
    if numbers and indexed:
        return (" (the classes are given by index, as in Caffe's val.txt; cnnkit expects "
                f"class names, the training folders': {shown})")  # fmt: skip
    return suggest(unknown[0], classes) or f" ({len(classes)} classes: {shown})"


def scan_folder(src: str | Path, labels_file: str | Path | None = None,
                classes: list[str] | None = None, skip_empty: bool = False,
                labels_option: str | None = None) -> Scan:  # fmt: skip
    """scan_images, with what it skipped named on stderr, as the loader names the images it
    cannot decode."""
    scan = scan_images(src, labels_file, classes, skip_empty, labels_option)
    report_skipped(scan.skipped, Path(src))
    return scan


def shared_files(held_out: Scan, training: Scan) -> list[tuple[str, str]]:
    """(held-out path, training path) of each real file both sets take: a link or a hard link
    in one to a file of the other (whose held-out figures would count images trained on)."""
    both = held_out.taken.keys() & training.taken.keys()
    return sorted((held_out.taken[k], training.taken[k]) for k in both)


def report_skipped(skipped: list[tuple[str, str]], root: Path | None = None) -> None:
    """Name skipped entries on stderr, one line each (the first few; then how many more)."""
    for path, reason in skipped[:REPORTED_LINES]:
        shown = printable(str(root / path) if root is not None else path)
        print(f"cnnkit: skipped {shown}: {reason}", file=sys.stderr)
    if len(skipped) > REPORTED_LINES:
        more = len(skipped) - REPORTED_LINES
        print(f"cnnkit: skipped {more} more {'entries' if more != 1 else 'entry'}", file=sys.stderr)
