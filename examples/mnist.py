"""pytorch/examples' mnist/main.py, converted to hps.

The lines marked ``# hps`` are the whole conversion (the README's snippet):
- import HpsOptimizer and the job's configuration;
- ``optim.Adadelta(model.parameters(), lr=args.lr)`` becomes ``HpsOptimizer(model, job=...)``
  with the same optimizer and learning rate (the root runs torch's Adadelta);
- ``DataLoader(dataset1, batch_size=..., shuffle=True)`` becomes a DataLoader over the
  optimizer's leased sampler, with ``set_epoch`` each epoch (as with DistributedSampler);
- rank 0 saves the model.
``StepLR`` stays as it is: the learning rate it sets travels with the pushes. ``--amp`` runs
the forward pass under bfloat16 autocast with a ``GradScaler``, unchanged from how one
process would.

The tier's address comes from ``HPS_ADDRESS``; rank and world size from the root (``RANK`` /
``WORLD_SIZE`` under torchrun). MNIST itself needs torchvision and a download, which this
repository does not depend on: this script trains on generated 28x28 digits of the same
shapes (a class-dependent bright square on noise; ``--samples`` of them).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

from worker import HpsOptimizer, JobConfig, OptimizerConfig  # hps


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


def train(args, model, device, train_loader, optimizer, epoch, scaler):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
            output = model(data)
            loss = F.nll_loss(output.float(), target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if batch_idx % args.log_interval == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}]\tLoss: {loss.item():.6f}", flush=True)
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {correct}/{len(test_loader.dataset)} "
          f"({100. * correct / len(test_loader.dataset):.0f}%)\n", flush=True)
    return test_loss


def synthetic(n: int, seed: int) -> TensorDataset:
    """28x28 'digits': class k is a bright 7x7 square at one of ten places, on noise,
    normalised as torchvision's MNIST transform would leave it."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.rand(n, 1, 28, 28, generator=g) * 0.3
    for k in range(10):
        r, c = 2 + 7 * (k // 4), 2 + 6 * (k % 4)
        images[labels == k, 0, r:r + 7, c:c + 7] += 0.7
    return TensorDataset((images - 0.1307) / 0.3081, labels)


def main():
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (hps)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N")
    parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N")
    parser.add_argument("--epochs", type=int, default=14, metavar="N")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M")
    parser.add_argument("--amp", action="store_true", default=False, help="bfloat16 autocast with a GradScaler")
    parser.add_argument("--dry-run", action="store_true", default=False)
    parser.add_argument("--seed", type=int, default=1, metavar="S")
    parser.add_argument("--log-interval", type=int, default=10, metavar="N")
    parser.add_argument("--save-model", action="store_true", default=False)
    parser.add_argument("--samples", type=int, default=6000, help="synthetic training samples")
    parser.add_argument("--job", default="mnist", help="the hps job's name")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    dataset1 = synthetic(args.samples, 0)
    dataset2 = synthetic(1000, 1)
    model = Net().to(device)
    optimizer = HpsOptimizer(model, job=JobConfig(name=args.job, optimizer=OptimizerConfig(  # hps
        kind="adadelta", lr=args.lr)))  # hps
    train_loader = DataLoader(dataset1, batch_sampler=optimizer.sampler(  # hps
        len(dataset1), args.batch_size, shard_size=4 * args.batch_size))  # hps
    test_loader = DataLoader(dataset2, batch_size=args.test_batch_size)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train_loader.batch_sampler.set_epoch(epoch)  # hps
        train(args, model, device, train_loader, optimizer, epoch, scaler)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model and optimizer.is_main:  # hps
        torch.save(model.state_dict(), "mnist_cnn.pt")
    print(f"rank {optimizer.rank} of {optimizer.world_size}: version {optimizer.version}", flush=True)


if __name__ == "__main__":
    main()
