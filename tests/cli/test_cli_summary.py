"""`coopt build`'s closing line: what ran where, including the ops left to PyTorch."""

from typer.testing import CliRunner

from coopt.cli.main import app

EMBEDDING_MODEL = """
import torch
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 8)
    def forward(self, tokens):
        return torch.relu(self.fc(self.emb(tokens)))
def get_init_inputs():
    return []
def get_inputs():
    return [torch.tensor([1, 2, 3])]
"""


def build_line(tmp_path, text: str, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    result = CliRunner().invoke(app, ["build", str(path), "-o", str(tmp_path / name), "--top-k", "1"])
    assert result.exit_code == 0, result.output
    return next(line for line in result.stdout.splitlines() if line.startswith("built "))


def test_the_summary_counts_the_ops_left_to_pytorch(tmp_path, plain_model_file):
    # the embedding gather is no region's: one PyTorch launch, said in the line and listed in the report
    line = build_line(tmp_path, EMBEDDING_MODEL, "emb")
    assert "0 on the reference, 1 op left to PyTorch; latency" in line, line
    assert "- `aten.embedding.default` ×1" in (tmp_path / "emb" / "report.md").read_text()
    # linear + relu: all of it in regions, nothing to say
    line = build_line(tmp_path, plain_model_file.read_text(), "plain")
    assert "left to PyTorch" not in line and "0 on the reference; latency" in line, line
