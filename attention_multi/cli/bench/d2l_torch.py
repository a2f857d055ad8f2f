"""d2l's PyTorch models, the counterparts of the MXNet models in
tests/fixtures/mxnet/make_model_fixtures.py: the d2l book's PyTorch code
(with its ``LazyLinear`` layers), at the fixtures' sizes.

The factories at the end build a model, call it once on an example input
(so that its lazy layers have shapes) and return it in eval mode: what
``am.port.load_into`` and ``attention-multi port --like`` need. The seq2seq
decoder uses this library's ``AdditiveAttention``; the Transformer takes
d2l's ``MultiHeadAttention`` or this library's (``attention="am"``).
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

import attention_multi as am

# ---- d2l: attention (chapter "Attention Mechanisms and Transformers") ----


def masked_softmax(X, valid_lens):
    def _sequence_mask(X, valid_len, value=0):
        maxlen = X.size(1)
        mask = (
            torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :]
            < valid_len[:, None]
        )
        X[~mask] = value
        return X

    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class DotProductAttention(nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = self.transpose_qkv(self.W_q(queries))
        keys = self.transpose_qkv(self.W_k(keys))
        values = self.transpose_qkv(self.W_v(values))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        return self.W_o(self.transpose_output(output))

    def transpose_qkv(self, X):
        X = X.reshape(X.shape[0], X.shape[1], self.num_heads, -1)
        X = X.permute(0, 2, 1, 3)
        return X.reshape(-1, X.shape[2], X.shape[3])

    def transpose_output(self, X):
        X = X.reshape(-1, self.num_heads, X.shape[1], X.shape[2])
        X = X.permute(0, 2, 1, 3)
        return X.reshape(X.shape[0], X.shape[1], -1)


def am_multi_head_attention(num_hiddens, num_heads, dropout, bias=False):
    """This library's MultiHeadAttention in place of d2l's."""
    return am.MultiHeadAttention(
        num_hiddens,
        num_hiddens,
        num_hiddens,
        num_hiddens,
        num_heads,
        dropout,
        bias=bias,
        backend="torch",
    )


ATTENTION = {"d2l": MultiHeadAttention, "am": am_multi_head_attention}


class PositionalEncoding(nn.Module):
    def __init__(self, num_hiddens, dropout, max_len=1000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.P = torch.zeros((1, max_len, num_hiddens))
        X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
            10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
        )
        self.P[:, :, 0::2] = torch.sin(X)
        self.P[:, :, 1::2] = torch.cos(X)

    def forward(self, X):
        X = X + self.P[:, : X.shape[1], :].to(X.device)
        return self.dropout(X)


class PositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_hiddens, ffn_num_outputs):
        super().__init__()
        self.dense1 = nn.LazyLinear(ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.LazyLinear(ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class AddNorm(nn.Module):
    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class TransformerEncoderBlock(nn.Module):
    def __init__(
        self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False, attention="d2l"
    ):
        super().__init__()
        self.attention = ATTENTION[attention](num_hiddens, num_heads, dropout, use_bias)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm2 = AddNorm(num_hiddens, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class TransformerEncoder(nn.Module):
    def __init__(
        self,
        vocab_size,
        num_hiddens,
        ffn_num_hiddens,
        num_heads,
        num_blks,
        dropout,
        use_bias=False,
        attention="d2l",
    ):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i),
                TransformerEncoderBlock(
                    num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias, attention
                ),
            )

    def forward(self, X, valid_lens):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        for blk in self.blks:
            X = blk(X, valid_lens)
        return X


class TransformerDecoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i, attention="d2l"):
        super().__init__()
        self.i = i
        self.attention1 = ATTENTION[attention](num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.attention2 = ATTENTION[attention](num_hiddens, num_heads, dropout)
        self.addnorm2 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm3 = AddNorm(num_hiddens, dropout)

    def forward(self, X, state):
        enc_outputs, enc_valid_lens = state[0], state[1]
        if state[2][self.i] is None:
            key_values = X
        else:
            key_values = torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        if self.training:
            batch_size, num_steps, _ = X.shape
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
        else:
            dec_valid_lens = None
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


class TransformerDecoder(nn.Module):
    def __init__(
        self,
        vocab_size,
        num_hiddens,
        ffn_num_hiddens,
        num_heads,
        num_blks,
        dropout,
        attention="d2l",
    ):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.num_blks = num_blks
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i),
                TransformerDecoderBlock(
                    num_hiddens, ffn_num_hiddens, num_heads, dropout, i, attention
                ),
            )
        self.dense = nn.LazyLinear(vocab_size)

    def init_state(self, enc_outputs, enc_valid_lens):
        return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

    def forward(self, X, state):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        for blk in self.blks:
            X, state = blk(X, state)
        return self.dense(X), state


class EncoderDecoder(nn.Module):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, enc_X, dec_X, *args):
        enc_all_outputs = self.encoder(enc_X, *args)
        dec_state = self.decoder.init_state(enc_all_outputs, *args)
        return self.decoder(dec_X, dec_state)[0]


# ---- d2l: seq2seq with a GRU encoder and Bahdanau attention ----


class GRU(nn.Module):
    """d2l.GRU: the PyTorch layer as ``self.rnn``."""

    def __init__(self, num_inputs, num_hiddens, num_layers, dropout=0):
        super().__init__()
        self.rnn = nn.GRU(num_inputs, num_hiddens, num_layers, dropout=dropout)

    def forward(self, inputs, H=None):
        return self.rnn(inputs, H)


class Seq2SeqEncoder(nn.Module):
    def __init__(self, vocab_size, embed_size, num_hiddens, num_layers, dropout=0):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = GRU(embed_size, num_hiddens, num_layers, dropout)

    def forward(self, X, *args):
        embs = self.embedding(X.t().type(torch.int64))
        outputs, state = self.rnn(embs)
        return outputs, state


class Seq2SeqAttentionDecoder(nn.Module):
    def __init__(self, vocab_size, embed_size, num_hiddens, num_layers, dropout=0):
        super().__init__()
        self.attention = am.AdditiveAttention(
            num_hiddens, num_hiddens, num_hiddens, dropout, backend="torch"
        )
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.rnn = nn.GRU(embed_size + num_hiddens, num_hiddens, num_layers, dropout=dropout)
        self.dense = nn.LazyLinear(vocab_size)

    def init_state(self, enc_outputs, enc_valid_lens):
        outputs, hidden_state = enc_outputs
        return (outputs.permute(1, 0, 2), hidden_state, enc_valid_lens)

    def forward(self, X, state):
        enc_outputs, hidden_state, enc_valid_lens = state
        X = self.embedding(X).permute(1, 0, 2)
        outputs = []
        for x in X:
            query = torch.unsqueeze(hidden_state[-1], dim=1)
            context = self.attention(query, enc_outputs, enc_outputs, enc_valid_lens)
            x = torch.cat((context, torch.unsqueeze(x, dim=1)), dim=-1)
            out, hidden_state = self.rnn(x.permute(1, 0, 2), hidden_state)
            outputs.append(out)
        outputs = self.dense(torch.cat(outputs, dim=0))
        return outputs.permute(1, 0, 2), [enc_outputs, hidden_state, enc_valid_lens]


# ---- d2l: LeNet with batch normalization; TextCNN (Conv1d) ----


class BNLeNet(nn.Module):
    def __init__(self, channels=(4, 8), hiddens=(16, 12), num_classes=5):
        super().__init__()
        self.net = nn.Sequential(
            nn.LazyConv2d(channels[0], kernel_size=5),
            nn.LazyBatchNorm2d(),
            nn.Sigmoid(),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.LazyConv2d(channels[1], kernel_size=5),
            nn.LazyBatchNorm2d(),
            nn.Sigmoid(),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Flatten(),
            nn.LazyLinear(hiddens[0]),
            nn.LazyBatchNorm1d(),
            nn.Sigmoid(),
            nn.LazyLinear(hiddens[1]),
            nn.LazyBatchNorm1d(),
            nn.Sigmoid(),
            nn.LazyLinear(num_classes),
        )

    def forward(self, X):
        return self.net(X)


class TextCNN(nn.Module):
    def __init__(self, vocab_size, embed_size, kernel_sizes, num_channels):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_size)
        self.constant_embedding = nn.Embedding(vocab_size, embed_size)
        self.dropout = nn.Dropout(0.5)
        self.decoder = nn.Linear(sum(num_channels), 2)
        # d2l's PyTorch code averages over time here; its MXNet code, the one
        # ported, takes the maximum (GlobalMaxPool1D).
        self.pool = nn.AdaptiveMaxPool1d(1)
        self.relu = nn.ReLU()
        self.convs = nn.ModuleList()
        for c, k in zip(num_channels, kernel_sizes):
            self.convs.append(nn.Conv1d(2 * embed_size, c, k))

    def forward(self, inputs):
        embeddings = torch.cat((self.embedding(inputs), self.constant_embedding(inputs)), dim=2)
        embeddings = embeddings.permute(0, 2, 1)
        encoding = torch.cat(
            [torch.squeeze(self.relu(self.pool(conv(embeddings))), dim=-1) for conv in self.convs],
            dim=1,
        )
        return self.decoder(self.dropout(encoding))


# ---- a d2l-style RNN language model: deep bidirectional LSTM, then an RNN ----


class RNNLM(nn.Module):
    def __init__(self, vocab_size, lstm_hiddens, rnn_hiddens):
        super().__init__()
        self.vocab_size = vocab_size
        self.lstm = nn.LSTM(vocab_size, lstm_hiddens, num_layers=2, bidirectional=True)
        # Gluon's rnn.RNN defaults to ReLU, PyTorch's nn.RNN to tanh
        self.rnn = nn.RNN(2 * lstm_hiddens, rnn_hiddens, nonlinearity="relu")
        self.linear = nn.LazyLinear(vocab_size)

    def forward(self, X):
        embs = F.one_hot(X.T.long(), self.vocab_size).type(torch.float32)
        hiddens, _ = self.rnn(self.lstm(embs)[0])
        return self.linear(hiddens).swapaxes(0, 1)


# ---- factories at the fixtures' sizes: built, called once, in eval mode ----


def _called(net, *example):
    net.eval()
    with torch.no_grad():
        net(*example)
    return net


def transformer(attention="d2l", num_blks=2):
    encoder = TransformerEncoder(11, 8, 16, 2, num_blks, 0.1, attention=attention)
    decoder = TransformerDecoder(11, 8, 16, 2, num_blks, 0.1, attention=attention)
    tokens = torch.zeros((1, 3), dtype=torch.int64)
    return _called(EncoderDecoder(encoder, decoder), tokens, tokens, torch.tensor([3]))


def seq2seq_gru():
    net = EncoderDecoder(
        Seq2SeqEncoder(10, 6, 8, 2, 0.1), Seq2SeqAttentionDecoder(10, 6, 8, 2, 0.1)
    )
    tokens = torch.zeros((1, 3), dtype=torch.int64)
    return _called(net, tokens, tokens, torch.tensor([3]))


def bn_lenet():
    return _called(BNLeNet(), torch.zeros((2, 1, 20, 20)))


def textcnn():
    return _called(
        TextCNN(12, 4, kernel_sizes=(2, 3), num_channels=(3, 4)),
        torch.zeros((1, 5), dtype=torch.int64),
    )


def rnn_lm():
    return _called(RNNLM(7, lstm_hiddens=5, rnn_hiddens=4), torch.zeros((1, 3), dtype=torch.int64))


FACTORIES = {
    "transformer": transformer,
    "seq2seq_gru": seq2seq_gru,
    "bn_lenet": bn_lenet,
    "textcnn": textcnn,
    "rnn_lm": rnn_lm,
}
