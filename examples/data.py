"""LightningDataModules on corpora that ship with the installed packages: nothing is ever downloaded.

* :class:`ByteTextDataModule`: byte-level language modelling on the text of CPython's
  ``pydoc_data.topics`` (the help topics of the standard library, ~466 KB of English and code).
* :class:`DigitsDataModule`: scikit-learn's ``load_digits`` (1797 8x8 grayscale digits) upsampled to
  small RGB images, or CIFAR-10 from a local folder of the python pickle batches.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset


def pydoc_topics_bytes() -> bytes:
    """The corpus: every ``pydoc_data.topics`` entry, in key order, joined by newlines, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


class ByteWindows(Dataset):
    """Windows of ``seq_len + 1`` bytes of ``data`` starting every ``stride`` bytes: ``(input, target)``
    pairs of ``seq_len`` tokens, the target shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int = 1) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"ByteWindows: {len(data)} bytes is too short for windows of seq_len + 1 = {seq_len + 1}")
        self.data, self.seq_len, self.stride = data, seq_len, stride

    def __len__(self) -> int:
        return (len(self.data) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.data[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


GeneratorStates = dict[str, torch.Tensor | None]  # a ResumableLoader's generator states by role ("loader", "sampler")


def _batches_done(data: pl.LightningDataModule) -> int:
    """The batches of the running fit's current epoch already trained on (0 outside a fit)."""
    trainer = data.trainer
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready if trainer is not None and trainer.training else 0


class ResumableLoader(DataLoader):
    """A training DataLoader that resumes a fit where its checkpoint left the data, also mid-epoch.

    Lightning keeps a loader's ``state_dict`` in every checkpoint and gives it back to ``load_state_dict`` on resume;
    here that is the state of the sampler's random generator (and the loader's own, where it has one) at the start of
    the pass over the data under way and at the checkpoint. The first pass after a restore starts from the first state
    and skips the ``batches_done()`` batches its epoch already trained on (Lightning's count, read when the pass
    starts: 0 where the checkpoint ended an epoch, and the pass starts from the second state): the resumed fit sees
    the batches of the uninterrupted one, in this epoch and the later ones. Without a restore it is a DataLoader.

    Args:
        batches_done: the batches of the current epoch already trained on when a pass starts
            (``trainer.fit_loop.epoch_loop.batch_progress.current.ready``).
        args, kwargs: DataLoader's; the data must be sized (Lightning prefetches no batch of a sized loader, so a
            checkpoint's state is that of the batches trained on).
    """

    def __init__(self, *args: Any, batches_done: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches_done = batches_done
        self._pass_start = self._states()
        self._restored: dict[str, GeneratorStates] | None = None

    def _generators(self) -> dict[str, torch.Generator | None]:
        """The random generators by role: the loader's own, and its sampler's where that is another one (Lightning's
        DistributedSampler, under DDP, has none: it orders by its seed and epoch)."""
        sampler = getattr(self.sampler, "generator", None)
        return {"loader": self.generator, "sampler": sampler if sampler is not self.generator else None}

    def _states(self) -> GeneratorStates:
        return {role: None if generator is None else generator.get_state() for role, generator in self._generators().items()}

    def __iter__(self) -> Iterator[Any]:
        return self._pass()

    def _pass(self) -> Iterator[Any]:
        skip = 0
        if self._restored is not None:
            restored, self._restored = self._restored, None
            skip = self.batches_done()
            saved, generators = restored["pass_start" if skip else "now"], self._generators()
            if {role for role, state in saved.items() if state is not None} == {role for role, g in generators.items() if g is not None}:
                for role, generator in generators.items():
                    if generator is not None:
                        generator.set_state(saved[role])
            else:
                warnings.warn(
                    "ResumableLoader: the checkpoint's data order came from other random generators (another number of "
                    "devices?): this epoch is drawn afresh from the loader's seed, past the batches already trained on",
                    UserWarning,
                    stacklevel=2,
                )
        self._pass_start = self._states()
        yield from islice(super().__iter__(), skip, None)

    def state_dict(self) -> dict[str, GeneratorStates]:
        return {"pass_start": self._pass_start, "now": self._states()}

    def load_state_dict(self, state_dict: dict[str, GeneratorStates]) -> None:
        self._restored = state_dict


class ByteTextDataModule(pl.LightningDataModule):
    """Byte-level tokens (vocabulary 256) of the ``pydoc_data.topics`` text, split 90/10 into train/val.

    Training draws windows at random offsets (a seeded generator, so runs repeat); an epoch is
    ``len(train bytes) // (seq_len + 1)`` windows, about one pass over the training text. Validation
    uses fixed, non-overlapping windows (at most ``val_windows`` of them); ``test`` uses the same held-out windows. A fit
    resumed from a checkpoint, also one saved mid-epoch, trains on the batches the uninterrupted run would have
    (:class:`ResumableLoader`).

    Args:
        seq_len: tokens per sequence (the model's context must be at least this long).
        batch_size: sequences per batch.
        val_fraction: the last part of the text held out for validation.
        val_windows: cap on the number of validation windows (``None``: all).
        seed: seed of the training sampler.
    """

    vocab_size = 256

    def __init__(
        self, seq_len: int = 128, batch_size: int = 32, val_fraction: float = 0.1, val_windows: int | None = 256, seed: int = 0
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"ByteTextDataModule: val_fraction={val_fraction} must lie in (0, 1)")
        self.seq_len, self.batch_size, self.val_fraction, self.val_windows, self.seed = seq_len, batch_size, val_fraction, val_windows, seed
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(pydoc_topics_bytes()), dtype=torch.uint8).long()
        split = int(len(data) * (1 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.seq_len)
        self.val_set = ByteWindows(data[split:], self.seq_len, stride=self.seq_len)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        windows_per_epoch = len(self.train_set.data) // (self.seq_len + 1)
        generator = torch.Generator().manual_seed(self.seed)
        sampler = RandomSampler(self.train_set, replacement=True, num_samples=windows_per_epoch, generator=generator)
        return ResumableLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=0, drop_last=True,
            batches_done=lambda: _batches_done(self),
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        count = len(self.val_set) if self.val_windows is None else min(self.val_windows, len(self.val_set))
        return DataLoader(torch.utils.data.Subset(self.val_set, range(count)), batch_size=self.batch_size, shuffle=False, num_workers=0)

    test_dataloader = val_dataloader


CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = "test_batch"
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def load_cifar10(folder: str | Path) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """CIFAR-10 from the python pickle batches in ``folder`` (or its ``cifar-10-batches-py`` subfolder):
    ``((train_images, train_labels), (test_images, test_labels))``, images uint8 ``(N, 3, 32, 32)``."""
    folder = Path(folder).expanduser()
    if not (folder / CIFAR10_TEST).is_file() and (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    missing = [name for name in (*CIFAR10_TRAIN, CIFAR10_TEST) if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"cifar10_dir={str(folder)!r} lacks the CIFAR-10 python batches {missing}; it must hold data_batch_1..5 and test_batch "
            "(the 'CIFAR-10 python version' archive, extracted). Nothing is downloaded."
        )

    def read(names) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as file:
                batch = pickle.load(file, encoding="bytes")
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch[b"labels"])
        return torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.long)

    return read(CIFAR10_TRAIN), read([CIFAR10_TEST])


def shifted_copies(images: torch.Tensor, shift: int, fill: float) -> torch.Tensor:
    """``images`` ``(n, c, h, w)`` and their copies shifted by ``shift`` pixels in each of the 8 directions:
    ``(9 n, c, h, w)``, copy ``k`` (``k = 3 (dy + 1) + (dx + 1)``, ``dy, dx`` in ``{-1, 0, 1}``) at rows ``k n`` to
    ``(k + 1) n``; pixels shifted in take ``fill``."""
    n, c, h, w = images.shape
    padded = F.pad(images, (shift, shift, shift, shift), value=fill)
    copies = [
        padded[..., shift + dy * shift : shift + dy * shift + h, shift + dx * shift : shift + dx * shift + w]
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
    ]
    return torch.cat(copies)


class DigitsDataModule(pl.LightningDataModule):
    """Image classification with 10 classes and no download.

    By default scikit-learn's ``load_digits`` (1797 grayscale 8x8 images, shipped with scikit-learn),
    upsampled bilinearly to ``image_size`` and repeated over 3 channels, normalised to zero mean and
    unit variance, with a seeded train/val split. With ``cifar10_dir`` pointing at a local CIFAR-10
    folder (python pickle batches ``data_batch_1..5`` and ``test_batch``), CIFAR-10 is used instead
    (train: the five data batches, val: the test batch; resized when ``image_size != 32``).

    Args:
        image_size: side of the square images the model sees.
        batch_size: images per batch.
        val_fraction: share of the digits held out for validation (ignored for CIFAR-10).
        cifar10_dir: a local CIFAR-10 folder; ``None`` for the digits.
        seed: seed of the split and of the training shuffle.
        val_shift: pixels (at ``image_size``); ``> 0`` also validates on every held-out image shifted by
            ``val_shift`` in each of the 8 directions (``shifted_copies``: 9x the images, the border filled with the
            background), a larger and harder validation set from the same digits, so that a final loss does not
            hang on a few confident mistakes. ``0``: the held-out images only.
    """

    num_classes = 10

    def __init__(
        self,
        image_size: int = 32,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        cifar10_dir: str | None = None,
        seed: int = 0,
        val_shift: int = 0,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"DigitsDataModule: val_fraction={val_fraction} must lie in (0, 1)")
        if not 0 <= val_shift < image_size:
            raise ValueError(f"DigitsDataModule: val_shift={val_shift} must lie in [0, image_size={image_size})")
        self.image_size, self.batch_size, self.val_fraction, self.cifar10_dir, self.seed = (
            image_size,
            batch_size,
            val_fraction,
            cifar10_dir,
            seed,
        )
        self.val_shift = val_shift
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.cifar10_dir is not None:
            (train_x, train_y), (val_x, val_y) = load_cifar10(self.cifar10_dir)
            mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
            train_x, val_x = ((self._resize(x.float() / 255) - mean) / std for x in (train_x, val_x))
        else:
            from sklearn.datasets import load_digits

            digits = load_digits()
            images = self._resize(torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16).repeat(1, 3, 1, 1)
            labels = torch.tensor(digits.target, dtype=torch.long)
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(self.seed))
            n_val = int(round(len(labels) * self.val_fraction))
            val_idx, train_idx = order[:n_val], order[n_val:]
            mean, std = images[train_idx].mean(), images[train_idx].std()
            images = (images - mean) / std
            train_x, train_y, val_x, val_y = images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]
        if self.val_shift:
            val_x, val_y = shifted_copies(val_x, self.val_shift, fill=float(train_x.min())), val_y.repeat(9)
        self.train_set, self.val_set = TensorDataset(train_x, train_y), TensorDataset(val_x, val_y)

    def _resize(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[-1] == self.image_size:
            return images
        return F.interpolate(images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "call setup() first"
        generator = torch.Generator().manual_seed(self.seed)
        return ResumableLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, generator=generator, num_workers=0, drop_last=True,
            batches_done=lambda: _batches_done(self),
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "call setup() first"
        return DataLoader(self.val_set, batch_size=256, shuffle=False, num_workers=0)

    test_dataloader = val_dataloader
