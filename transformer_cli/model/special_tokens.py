"""The ids of the special pieces in every sentencepiece model `tfm prepare` trains (and that
imported models are checked to have): what every stage agrees on, importable without torch."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
