"""pytorch/examples' word_language_model/main.py (with its model.py and data.py), converted to hps.

The lines marked ``# hps`` are the conversion:
- import HpsOptimizer and the job's configuration;
- the script's hand-written SGD (``p.data.add_(p.grad, alpha=-lr)``) and its
  ``clip_grad_norm_(model.parameters(), args.clip)`` become one ``opt.step()`` on a job whose
  root clips the averaged gradient to ``args.clip`` (``OptimizerConfig.clip_grad_norm``: what
  clipping after DDP's all-reduce does; clipping in the script would clip each worker's own
  gradient instead);
- each worker trains its share of every batch's columns (``train_data[:, rank::world_size]``),
  so the workers' steps together are the single process's step on the whole batch;
- the annealing ``lr /= 4.0`` also sets the optimizer's groups (the new rate travels with the
  next push);
- rank 0 saves the model.

The tier's address comes from ``HPS_ADDRESS``; rank and world size from the root. The corpus:
WikiText-2 needs a download this repository does not make; the default corpus is a Python
standard-library module's source, split into lines and words the same way data.py splits
WikiText (``--data FILE`` trains on any text file).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from worker import HpsOptimizer, JobConfig, OptimizerConfig  # hps


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        with open(path, encoding="utf8") as f:
            lines = [line for line in f if line.strip()]
        a, b = int(len(lines) * 0.8), int(len(lines) * 0.9)
        self.train = self.tokenize(lines[:a])
        self.valid = self.tokenize(lines[a:b])
        self.test = self.tokenize(lines[b:])

    def tokenize(self, lines):
        idss = []
        for line in lines:
            words = line.split() + ["<eos>"]
            idss.append(torch.tensor([self.dictionary.add_word(w) for w in words], dtype=torch.int64))
        return torch.cat(idss)


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


parser = argparse.ArgumentParser(description="PyTorch Wikitext-2 RNN/LSTM Language Model (hps)")
parser.add_argument("--data", type=str, default=argparse.__file__, help="a text file (default: argparse's source)")
parser.add_argument("--model", type=str, default="LSTM", help="type of network (RNN_TANH, RNN_RELU, LSTM, GRU)")
parser.add_argument("--emsize", type=int, default=200)
parser.add_argument("--nhid", type=int, default=200)
parser.add_argument("--nlayers", type=int, default=2)
parser.add_argument("--lr", type=float, default=20)
parser.add_argument("--clip", type=float, default=0.25)
parser.add_argument("--epochs", type=int, default=40)
parser.add_argument("--batch_size", type=int, default=20, metavar="N")
parser.add_argument("--bptt", type=int, default=35)
parser.add_argument("--dropout", type=float, default=0.2)
parser.add_argument("--tied", action="store_true")
parser.add_argument("--seed", type=int, default=1111)
parser.add_argument("--log-interval", type=int, default=200, metavar="N")
parser.add_argument("--save", type=str, default="model.pt")
parser.add_argument("--job", default="wlm", help="the hps job's name")
args = parser.parse_args()

torch.manual_seed(args.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

corpus = Corpus(args.data)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

ntokens = len(corpus.dictionary)
model = RNNModel(args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout, args.tied).to(device)
criterion = nn.NLLLoss()
opt = HpsOptimizer(model, job=JobConfig(name=args.job, optimizer=OptimizerConfig(  # hps
    kind="sgd", lr=args.lr, clip_grad_norm=args.clip)))  # hps
train_data = train_data[:, opt.rank::opt.world_size]  # hps: this worker's share of each batch


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    model.train()
    total_loss = 0.
    start_time = time.time()
    hidden = model.init_hidden(train_data.size(1))  # hps: this worker's columns
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        opt.step(loss=loss)  # hps: replaces clip_grad_norm_ and the p.data.add_ loop

        total_loss += loss.item()
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | lr {lr:02.2f} | "
                  f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f} | "
                  f"ppl {math.exp(cur_loss):8.2f}", flush=True)
            total_loss = 0
            start_time = time.time()


lr = args.lr
best_val_loss = None
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    print("-" * 89)
    print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | valid loss {val_loss:5.2f} | "
          f"valid ppl {math.exp(val_loss):8.2f}", flush=True)
    print("-" * 89)
    if not best_val_loss or val_loss < best_val_loss:
        if opt.is_main:  # hps
            with open(args.save, "wb") as f:
                torch.save(model.state_dict(), f)
        best_val_loss = val_loss
    else:
        lr /= 4.0
        for group in opt.param_groups:  # hps
            group["lr"] = lr  # hps

test_loss = evaluate(test_data)
print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}", flush=True)
print(f"rank {opt.rank} of {opt.world_size}: version {opt.version}", flush=True)
