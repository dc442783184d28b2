"""The eager oracle every executor test compares with: plain PyTorch training."""
import torch


def train_eager(model, data, *, lr, weight_decay=0.0, optimizer="adamw", loss=lambda m, x, y: m(x, y)):
    """Train `model` on `data` ((x, y) batches) with torch.optim.Adam/AdamW over its trainable
    parameters; returns (losses, parameters by name)."""
    cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    opt = cls([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=weight_decay)
    losses = []
    for x, y in data:
        opt.zero_grad()
        value = loss(model, x, y)
        value.backward()
        opt.step()
        losses.append(value.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
