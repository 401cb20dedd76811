"""The examples run as documented, offline, and what they write is a store training reads."""
import subprocess
import sys
from pathlib import Path

from conftest import ENV, run_openclip
from drrho_openclip.demo import csv_data_args, train_args
from drrho_openclip.features import FeatureStore

EXAMPLES = Path(__file__).resolve().parents[1] / 'examples'


def test_import_timm_features_writes_a_verified_store_that_drrho_trains_with(tmp_path, shapes):
    work = tmp_path / 'example'
    result = subprocess.run([sys.executable, EXAMPLES / 'import_timm_features.py', '--workdir', work,
                             '--samples', '32'], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-3] == 'OK'  # verify's verdict, before the training command
    store = FeatureStore.open(work / 'ref')
    assert store.num_samples == 32 and store.dim == 512 and store.model.startswith('timm resnet18')
    train_csv = work / 'data' / 'train.csv'
    run_openclip(train_args(shapes['model'], csv_data_args(train_csv), tmp_path / 'logs', 'drrho', epochs=1,
                            batch_size=16, lr=1e-3, workers=0, extra=['--loss', 'drrho', '--ref-features',
                                                                      work / 'ref']))
    assert (tmp_path / 'logs' / 'drrho' / 'checkpoints' / 'epoch_1.pt').is_file()
