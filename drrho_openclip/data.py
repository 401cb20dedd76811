"""The training data as files: a CSV file or WebDataset shards, as OpenCLIP reads them, named as the feature store
names its shards. What the store's commands (precompute, import, verify) and the training flags share."""
import hashlib
import logging
import os
import re
from typing import Iterable, Optional, Sequence, Tuple
from urllib.parse import urlparse

import pandas as pd
import webdataset

from .features import shard_name

IMAGE_EXTENSIONS = ('jpg', 'png', 'jpeg', 'webp')  # those OpenCLIP's WebDataset pipeline reads, in its order


def input_kind(train_data, dataset_type: str = 'auto') -> Optional[str]:
    """'csv', 'synthetic' or 'webdataset': `dataset_type`, or for 'auto' what OpenCLIP 3.3's get_dataset_fn makes of
    `train_data`: the text after its last dot, as written ('csv' or 'tsv': a CSV; 'tar': WebDataset shards, several
    sources joined by '::' included). OpenCLIP refuses any other ending, which raises a ValueError here that names
    it. None without data (an evaluation)."""
    if dataset_type != 'auto':
        return dataset_type
    if train_data is None:
        return None
    extension = str(train_data).split('.')[-1]
    if extension in ('csv', 'tsv'):
        return 'csv'
    if extension == 'tar':
        return 'webdataset'
    raise ValueError(f"--train-data '{train_data}': --dataset-type auto tells the data's type by the text after its "
                     f"last dot, as OpenCLIP does ('csv', 'tsv' or 'tar'), and this ends in '{extension}': give "
                     f"--dataset-type webdataset or csv")


def add_data_args(p, required: bool):
    """The flags that name the training data, as OpenCLIP's own."""
    p.add_argument('--train-data', required=required,
                   help="a CSV/TSV file, or WebDataset shards (brace expansion; several sources joined by '::')")
    p.add_argument('--dataset-type', choices=['auto', 'csv', 'webdataset'], default='auto')
    p.add_argument('--csv-separator', default='\t')
    p.add_argument('--csv-img-key', default='filepath')
    p.add_argument('--csv-caption-key', default='title')


def resolve_dataset_type(args):
    """`args` with --dataset-type auto resolved by `input_kind` (one it cannot resolve stops, naming the data)."""
    if args.train_data:
        try:
            args.dataset_type = input_kind(args.train_data, args.dataset_type)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return args


def shard_urls(train_data: str):
    """Every WebDataset shard URL of --train-data, in order, as webdataset reads them: its '::'-joined sources, each
    `${VAR}` replaced by the environment's WDS_VAR (webdataset >= 0.2.48), brace-expanded."""
    unset = sorted({name for name in re.findall(r'\$\{(\w+)\}', train_data) if f'WDS_{name}' not in os.environ})
    if unset and hasattr(webdataset.shardlists, 'envsubst'):
        raise SystemExit(f"--train-data '{train_data}': webdataset reads ${{{unset[0]}}} from the environment "
                         f"variable WDS_{unset[0]}, which is not set")
    try:
        return webdataset.shardlists.expand_urls(train_data)
    except AssertionError as e:  # a variable in a variable's value that is not set
        raise SystemExit(f"--train-data '{train_data}': webdataset cannot expand it: {e}") from None


def sources(args):
    """[(store shard name, source)] in store order: the CSV file, or every WebDataset shard URL as given (once)."""
    if args.dataset_type == 'csv':
        return [(shard_name(args.train_data), args.train_data)]
    urls = shard_urls(args.train_data)
    collision = shard_name_collision(urls)
    if collision:
        raise SystemExit(f"shard file names must be unique (a store keys shards by file name): '{collision[0]}' and "
                         f"'{collision[1]}' are both shard '{shard_name(collision[0])}'")
    return list({shard_name(url): url for url in urls}.items())  # a shard given twice (upsampled) is written once


def local_file_sizes(named_urls) -> dict:
    """{shard name: size in bytes} of the WebDataset shards ([(name, url)]) that are local files: recorded in a store
    so that training can tell another dataset's shard of the same name (and keys) from the one it was written for."""
    local = ((name, local_path(url)) for name, url in named_urls)
    return {name: os.path.getsize(path) for name, path in local if path is not None and os.path.isfile(path)}


def local_path(url: str) -> Optional[str]:
    """The local file a shard URL names, as webdataset reads it (a path, or a `file:` URL), or None for another URL
    or a `pipe:` command."""
    parsed = urlparse(url)
    return parsed.path if parsed.scheme == 'file' else url if parsed.scheme == '' else None


def missing_local_file(named_urls) -> Optional[str]:
    """The first of the sources ([(name, url)]) that is a local file and does not exist, or None: found before any
    work, so that a mistyped shard range stops a run that would end at that shard."""
    for _, url in named_urls:
        local = local_path(url)
        if local is not None and not os.path.isfile(local):
            return url
    return None


def shard_name_collision(urls, named=shard_name) -> Optional[Tuple[str, str]]:
    """The first two different URLs with one shard name (`named`: a store's), or None: a store keys shards by file
    name, so they would read one shard's features and per-sample state (the same URL twice reads the same shard: no
    collision)."""
    first = {}
    for url in urls:
        seen = first.setdefault(named(url), url)
        if seen != url:
            return seen, url
    return None


def csv_frame(path, separator, **options) -> pd.DataFrame:
    """`pd.read_csv`, stopping with the file named where pandas cannot read it (an empty file, text that is not UTF-8,
    a row after the first with more fields than the header: a caption holding the separator), rather than with
    pandas' traceback. (An extra field in the first row makes pandas read the first column as the index, as OpenCLIP
    reads it too; the column check then finds the columns shifted.)"""
    try:
        return pd.read_csv(path, sep=separator, **options)
    except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as e:
        hint = "; save it as UTF-8" if isinstance(e, UnicodeDecodeError) else ""
        raise SystemExit(f"{path}: cannot be read as a CSV with --csv-separator {separator!r} "
                         f"({type(e).__name__}: {str(e).strip()}{hint})") from None


def check_csv_columns(args, keys):
    """Stop, naming the CSV and the columns it has, unless every one of `keys` is a column of its header (a
    comma-separated file read with OpenCLIP's default tab has one column: the whole header)."""
    columns = csv_frame(args.train_data, args.csv_separator, nrows=0).columns
    for key in keys:
        if key not in columns:
            one = len(columns) == 1
            raise SystemExit(f"{args.train_data}: no column '{key}' (columns with --csv-separator "
                             f"{args.csv_separator!r}: {', '.join(map(repr, columns))}"
                             + ("; is the file separated by another character?" if one else "") + ")")


def read_csv(args):
    check_csv_columns(args, (args.csv_img_key, args.csv_caption_key))
    frame = csv_frame(args.train_data, args.csv_separator)
    if frame.empty:
        raise SystemExit(f"{args.train_data}: no rows below its header, so no image-text samples")
    return frame


def common_folder(paths: Sequence) -> str:
    """The deepest folder every path lies in ('' where there is none: relative paths from the current folder, or
    absolute and relative ones mixed)."""
    try:
        return os.path.commonpath({os.path.dirname(str(p)) for p in paths}) if len(paths) else ''
    except ValueError:
        return ''


def relative_to_common_folder(paths: Sequence) -> list:
    """The paths relative to `common_folder`: what stays the same when a dataset's folder moves."""
    root = common_folder(paths)
    return [os.path.relpath(str(p), root) if root else str(p) for p in paths]


def moved_folders(stored: Sequence, current: Sequence) -> Optional[Tuple[str, str]]:
    """(the folder the `stored` paths lie below, the one the `current` paths lie below) where both lists name the same
    files in the same order below different folders (a moved dataset), else None."""
    if relative_to_common_folder(stored) != relative_to_common_folder(current):
        return None
    return common_folder(stored) or '.', common_folder(current) or '.'


def sha256_of(texts: Iterable) -> str:
    """A fingerprint of strings in order (each as str, NUL-terminated: ['ab', 'c'] and ['a', 'bc'] differ)."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(str(text).encode() + b'\0')
    return digest.hexdigest()


def caption_digests(args, frame: pd.DataFrame = None) -> dict:
    """{store shard name: `sha256_of` its captions} of a CSV (the --csv-caption-key column, as OpenCLIP's CsvDataset
    reads it), {} for WebDataset, whose captions live in the tar files the store's sizes describe. A store records
    them: the same image paths with other captions (another caption column, an edited file) would otherwise read
    text features of other texts. `frame`: the CSV, where read."""
    if args.dataset_type != 'csv':
        return {}
    frame = read_csv(args) if frame is None else frame
    return {shard_name(args.train_data): sha256_of(frame[args.csv_caption_key])}


def image_sizes(args, frame: pd.DataFrame = None) -> dict:
    """{store shard name: {row: size}} of a CSV's first, middle and last image files, as OpenCLIP opens them
    (a relative path from the working directory), {} for WebDataset; `frame`: the CSV, where read. A store records
    them: the same CSV read from another folder names other files by the same relative paths, whose features the
    store does not hold."""
    if args.dataset_type != 'csv':
        return {}
    frame = read_csv(args) if frame is None else frame
    return {shard_name(args.train_data): _sampled_image_sizes(list(frame[args.csv_img_key]))}


def _sampled_image_sizes(images: Sequence[str]) -> dict:
    sizes = {}
    for row in sorted({0, len(images) // 2, len(images) - 1} - {-1}):
        try:
            sizes[str(row)] = os.path.getsize(images[row])
        except OSError:  # not there: training names it when it reads the row
            pass
    return sizes


def image_mismatch(shard, args, images: Sequence[str]) -> Optional[str]:
    """Why the CSV's image files (`images`, its image column) are not those the store's `shard` was written from,
    by the sizes it recorded (`image_sizes`), or None (also for a store that recorded none)."""
    now = _sampled_image_sizes(images)
    for row, size in (shard.image_bytes or {}).items():
        if now.get(row) != size:
            return (f"row {row} (from 0, the header not counted) of '{args.train_data}' names "
                    f"'{images[int(row)]}', of {now.get(row, 'no')} bytes, where the store's features are of a file "
                    f"of {size} bytes: another image by the same path (a relative path is read from the working "
                    f"directory, here '{os.getcwd()}'): run from the folder the store was written in, or write it "
                    f"again")
    return None


def caption_mismatch(shard, digest: str, args) -> Optional[str]:
    """Why the store's `shard` was not written from the captions of `digest` (`caption_digests`), or None (also for
    a store that recorded none: written before stores did, or from WebDataset)."""
    if shard.captions_sha256 is None or shard.captions_sha256 == digest:
        return None
    return (f"shard '{shard.name}' was written from other captions than column '{args.csv_caption_key}' of "
            f"'{args.train_data}' holds (another --csv-caption-key, or the file's captions changed since): its text "
            f"features describe other texts; write the store again for these captions")


def _grouped(members):
    """Tar members grouped into samples as OpenCLIP's training groups them: consecutive members of one key make a
    sample, and a member whose extension its sample already holds starts another sample of the same key (where
    webdataset's own grouping raises)."""
    from webdataset.tariterators import base_plus_ext, valid_sample
    sample = None
    for member in members:
        key, extension = base_plus_ext(member['fname'])
        if key is None:
            continue
        extension = extension.lower()
        if sample is None or key != sample['__key__'] or extension in sample:
            if valid_sample(sample):
                yield sample
            sample = {'__key__': key, '__url__': member['__url__']}
        sample[extension] = member['data']
    if valid_sample(sample):
        yield sample


class UnreadableShard(OSError):
    """A WebDataset shard that cannot be read: a local file that is no tar (or none from its first header on), or
    a stream (`pipe:`, http) that failed; its message names it."""


def _raw_samples(url):
    """The image-text samples of one tar shard, in file order, undecoded (what OpenCLIP's training filter keeps).
    A local file cut short or corrupt after some members gives those, with a warning, as OpenCLIP's training reads
    it (its handler logs the error and goes on with the next shard); one of none, or a stream that fails (where the
    samples before the failure depend on when it failed, so training may read others), is an `UnreadableShard`."""
    from webdataset.tariterators import tar_file_expander, url_opener
    errors, members, samples = [], 0, 0

    def go_on(error):
        errors.append(error)
        return True

    def counted(stream):
        nonlocal members
        for member in stream:
            members += 1
            yield member

    # not wds.WebDataset: it splits its shards over loader workers and refuses to run under torchrun
    for sample in _grouped(counted(tar_file_expander(url_opener([{'url': url}]), handler=go_on))):
        if 'txt' in sample and any(e in sample for e in IMAGE_EXTENSIONS):
            samples += 1
            yield sample
    if not errors:
        silent_end = _silent_end(local_path(url)) if local_path(url) is not None else None
        if silent_end is not None:
            logging.warning(f"'{url}' {silent_end}: read as OpenCLIP's training reads it, its {samples} samples "
                            f"before that point and none after, without an error; if it should hold more, download "
                            f"or write it again")
        return
    error = f"{type(errors[0]).__name__}: {errors[0].args[0] if errors[0].args else errors[0]}"
    if local_path(url) is None:
        raise UnreadableShard(f"'{url}' failed after {samples} samples ({error}): a stream that failed (run again "
                              f"once it reads: the shards written so far are kept), or a shard cut short (download "
                              f"it again, or leave it out of --train-data)")
    if not members:
        csv = any(f'.{kind}' in os.path.basename(url).lower() for kind in ('csv', 'tsv'))
        raise UnreadableShard(f"no sample of '{url}' can be read ({error}): a failed download, or no tar file? "
                              f"Download it again and run again (the shards written so far are kept)"
                              + (" (a CSV file? pass --dataset-type csv)" if csv else ""))
    logging.warning(f"'{url}' is cut short or corrupt after {samples} samples ({error}): read as OpenCLIP's "
                    f"training reads it, those {samples} samples and none after (it skips the rest with a warning); "
                    f"for the rest, download it again and write the store again from the start (--overwrite, or "
                    f"delete the unfinished store's .partial folder)")


def _silent_end(path) -> Optional[str]:
    """What is wrong with the end of the local uncompressed tar file `path`, or None. tarfile ends a stream at a
    damaged header, or at the end of a file without tar's end-of-archive blocks, as if at the end (only a first
    header it cannot read raises), so a download cut on a member's boundary (or allocated in full and cut, leaving
    zeros), a flipped byte in a header, or two tar files joined together read as fewer samples, in precompute and in
    training alike, without a word."""
    import tarfile
    try:
        with tarfile.open(path, 'r:') as archive:  # headers only: it seeks over the members' data
            for _ in archive:
                pass
            end = archive.offset  # the header it stopped at
    except (tarfile.TarError, OSError):  # compressed: the stream reader has read it; not a tar: it has said so
        return None
    size = os.path.getsize(path)
    with open(path, 'rb') as tail:
        tail.seek(end)
        while chunk := tail.read(1 << 20):
            if chunk.count(0) != len(chunk):
                return (f"is read up to byte {end} of its {size}, and more data follows: a damaged header there, "
                        f"or another tar file joined after its end (a tar reader stops at the first end)")
    if size - end < 1024:
        return ("ends without the two empty blocks that end a tar file: cut short on a member's boundary (an "
                "interrupted download or copy)?")
    if size - end > 1024 + tarfile.RECORDSIZE:  # the end's two blocks, and the padding of its last record
        return (f"is read up to byte {end} of its {size}, and zeros follow, more than a tar file's end takes: a "
                f"download whose file was allocated in full and cut short?")
    return None


def _decoder():
    """What OpenCLIP's training pipeline decodes samples with (`wds.decode('pilrgb')`), callable on one sample."""
    import webdataset as wds
    return wds.autodecode.Decoder([wds.autodecode.imagehandler('pilrgb')])


def shard_samples(url, decode=True):
    """(key, image, caption) of every image-text sample of one tar shard, in file order (raw bytes unless decode).
    Decoding as OpenCLIP's training does, a sample it cannot decode is left out with a warning, as training leaves
    it out (its decode stage skips it): one bad image must not stop a store from being written."""
    decoder = _decoder() if decode else None
    for sample in _raw_samples(url):
        if decoder is not None:
            try:
                sample = decoder(sample)
            except Exception as e:  # noqa: BLE001 - whatever the decoder raises, as training's handler catches all
                logging.warning(f"'{url}': sample '{sample['__key__']}' cannot be decoded ({type(e).__name__}: "
                                f"{e}); left out of the store, as OpenCLIP's training leaves it out")
                continue
        yield sample['__key__'], next(sample[e] for e in IMAGE_EXTENSIONS if e in sample), sample['txt']


def undecodable_keys(url, keys) -> set:
    """Those of `keys` whose sample in the tar shard `url` cannot be decoded: precompute leaves them out of a
    store, and training never reads them."""
    wanted, decoder, found = set(keys), _decoder(), set()
    for sample in _raw_samples(url):
        if sample['__key__'] in wanted:
            try:
                decoder(sample)
            except Exception:  # noqa: BLE001 - as in shard_samples
                found.add(sample['__key__'])
    return found


def shard_keys(url):
    """The keys of one tar shard's image-text samples, in file order (nothing decoded)."""
    return [key for key, _, _ in shard_samples(url, decode=False)]


def data_keys(args, frame: pd.DataFrame = None):
    """{store shard name: keys of its image-text samples} of --train-data; `frame`: a CSV, where read."""
    if args.dataset_type == 'csv':
        frame = read_csv(args) if frame is None else frame
        return {shard_name(args.train_data): [str(k) for k in frame[args.csv_img_key]]}
    return {name: shard_keys(url) for name, url in sources(args)}
