"""Embedding readout: the tokens and their positions read off a text model's embedding gradients, no
optimisation (``textleak``: the maths).

A model that trains its token embedding and a learned position embedding (``transformer3``, GPT-2- and
BERT-like models without frozen embeddings) transmits both gradients. Their rows are sums of the same
per-position vectors, so the token rows name the batch's tokens (the bag, Gupta et al. 2022) and matching
them to the position rows puts each token at its position (the readout of Fowl et al. 2022,
"Decepticons", which needs no malicious model for this step). One sequence (B = 1): a least-squares
assignment, exact without a defense for every position that feeds a prediction. B > 1: B tokens per
position by matching pursuit, then the sequences untangled by a bigram model of the attacker's auxiliary
text (a linear assignment per position, as LAMP orders tokens with a language model); without auxiliary
text, the order within a position is arbitrary and only the bag and the positions are right.

Defenses, as the attacker knows them (never their randomness): sign compression keeps a single token's
row identical to its position's row (both are signs of one vector), so the readout survives it;
pruning per layer keeps the sparse token rows whole and cuts the dense position rows, which are then
compared on their surviving coordinates (equal to the token row's there); Gaussian noise or DP-SGD drown the
rows (the bag falls back to rows whose norm stands out, ``token_bag``), and the readout then reads noise.

Gaps, stated: a causal LM's last position has no target, so its row is zero and its token is missing from
the bag unless it occurs earlier; that position (and any whose row pruning zeroed) is filled with the
bigram model's most likely follower of the previous token (the most frequent auxiliary token without one;
token 0 without auxiliary text). A classifier's labels come from the threat model (granted, or restored
from the output layer as for images). Not applicable when either embedding is not in the update (a
frozen, tied embedding: Wu et al.'s ``transformer3-tied``; sinusoidal or rotary positions).
"""

from __future__ import annotations

from guardfl.redteam.attacks.base import Attack, AttackConfig, Capabilities, NotApplicable, Reconstruction
from guardfl.redteam.attacks.labels import labels_for
from guardfl.redteam.attacks.registry import register
from guardfl.redteam.attacks.text.textleak import Bigram, assign_positions, order_sequences, position_sets, token_bag
from guardfl.redteam.modality.text.models import embedding_names, is_text_model, next_token_labels


class EmbeddingReadoutConfig(AttackConfig):
    pass


@register
class EmbeddingReadout(Attack):
    """Tokens from the token embedding's gradient rows, placed by the position embedding's rows (analytic)."""

    name = "embedding_readout"
    Config = EmbeddingReadoutConfig
    capabilities = Capabilities(modalities=frozenset({"text"}), threat=frozenset({"labels", "defense"}))
    paper_budget = "analytic (no iterations): Fowl et al. 2022's readout on an honest server's observation"

    def __init__(self, **budget) -> None:
        super().__init__(**budget)
        self._bigram: tuple[str, Bigram] | None = None

    @classmethod
    def _refuses(cls, setting, threat) -> str | None:
        if not is_text_model(setting.model):
            return "the model does not follow the text-model protocol (task, get_input_embeddings)"
        token, position = embedding_names(setting.model)
        updated = set(setting.param_names)
        if token not in updated:
            return "reads the token embedding's gradient, which this client does not send (the embedding is frozen or tied)"
        if position not in updated:
            return "reads a learned position embedding's gradient; this model has none in its update"
        return None

    def _bigram_for(self, aux, vocab: int) -> Bigram | None:
        """The auxiliary text's bigram model (built once per auxiliary set), None without token-id aux."""
        if aux is None or aux.images.dim() != 2 or aux.images.is_floating_point() or int(aux.images.max()) >= vocab:
            return None
        if self._bigram is None or self._bigram[0] != aux.digest():
            self._bigram = (aux.digest(), Bigram(aux.images, vocab))
        return self._bigram[1]

    def _reconstruct(self, observation, knowledge, device, gen) -> Reconstruction:
        model = observation.model
        n, length = observation.num_samples, observation.input_shape[0]
        token_name, position_name = embedding_names(model)
        if token_name not in observation.update or position_name not in observation.update:
            raise NotApplicable(f"{self.name}: the update lacks the token or position embedding's gradient")
        token_rows = observation.update[token_name].detach().float().cpu()
        position_rows = observation.update[position_name].detach().float().cpu()[:length]
        bag = token_bag(token_rows, n * length)
        bigram = self._bigram_for(knowledge.aux, token_rows.shape[0])
        fill = bigram.most_frequent if bigram is not None else 0
        if bag is None:
            sets: list[list[int]] = [[] for _ in range(length)]
        else:
            rows = token_rows[bag]
            if n == 1:
                sets = [[int(bag[i])] if i >= 0 else [] for i in assign_positions(rows, position_rows).tolist()]
            else:
                sets = [[int(bag[i]) for i in s] for s in position_sets(rows, position_rows, n)]
        tokens = order_sequences(sets, n, bigram, fill)
        if model.task == "causal-lm":
            labels = next_token_labels(tokens)
        else:
            labels = labels_for(observation, knowledge)[0].cpu()
        read = sum(len(s) for s in sets)
        info = {"bag": None if bag is None else int(len(bag)), "positions_read": read, "of": n * length,
                "ordered_by": "aux bigram" if bigram is not None else ("none needed" if n == 1 else "arbitrary")}
        return Reconstruction(tokens, labels, float(n * length - read), [], info)
