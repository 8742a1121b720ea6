"""Small text domains the tests write themselves: the Blitzer review layout (AmazonReviews) and
the generic ``<domain>/<class>/<file>.txt`` tree, with words that carry the sentiment."""

from __future__ import annotations

import random
from pathlib import Path

DOMAINS = ("books", "dvd", "electronics", "kitchen")
FOLDERS = {"kitchen": "kitchen_&_housewares"}  # as unprocessed.tar.gz names it
GOOD = ("great", "excellent", "love", "wonderful", "best", "perfect")
BAD = ("awful", "terrible", "waste", "broken", "worst", "boring")
TOPIC = {
    "books": ("author", "novel", "chapter"),
    "dvd": ("movie", "actor", "scene"),
    "electronics": ("battery", "screen", "cable"),
    "kitchen": ("pan", "knife", "blender"),
}


def review(domain: str, positive: bool, rng: random.Random) -> str:
    words = [rng.choice(GOOD if positive else BAD) for _ in range(3)]
    words += [rng.choice(TOPIC.get(domain, ("thing",))) for _ in range(4)]
    rng.shuffle(words)
    return "this " + " ".join(words) + " & more."


def write_reviews(root: Path, n_per_class: int = 12, seed: int = 0) -> Path:
    """``root/sorted_data_acl/<domain>/{positive,negative}.review``, pseudo-XML as Blitzer's."""
    rng = random.Random(seed)
    base = root / "sorted_data_acl"
    for domain in DOMAINS:
        folder = base / FOLDERS.get(domain, domain)
        folder.mkdir(parents=True)
        for cls, positive in (("positive", True), ("negative", False)):
            entries = [
                "<review>\n<unique_id>\nx\n</unique_id>\n<rating>\n"
                f"{5.0 if positive else 1.0}\n</rating>\n<review_text>\n"
                f"{review(domain, positive, rng)}\n</review_text>\n</review>\n"
                for _ in range(n_per_class)
            ]
            (folder / f"{cls}.review").write_text("".join(entries), encoding="utf-8")
    return base


def write_text_folder(root: Path, n_per_class: int = 6, seed: int = 0) -> Path:
    """``root/<domain>/<class>/<k>.txt`` for three domains and two classes."""
    rng = random.Random(seed)
    for domain in DOMAINS[:3]:
        for cls, positive in (("neg", False), ("pos", True)):
            folder = root / domain / cls
            folder.mkdir(parents=True)
            for k in range(n_per_class):
                (folder / f"{k}.txt").write_text(review(domain, positive, rng), encoding="utf-8")
    return root
