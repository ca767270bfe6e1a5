// The console's only script, served from the binary. Pages work without it: it adds live
// updates (server-sent events) to the approvals inbox, an active run's page and a thread being
// answered (with the model's text as it is written), and keyboard
// shortcuts on the inbox (j/k move between held calls, a/d approve or deny with the reason).
'use strict';

(function () {
  const main = document.querySelector('main');
  if (!main) return;
  // What a page's own script does once a refresh has put the fresh content in place.
  let afterRefresh = () => {};

  // Replaces the page's content with a fresh rendering of the same page, unless the person is
  // typing in it: then a notice offers the reload instead.
  async function refresh() {
    const typing = Array.from(main.querySelectorAll('input[type=text], textarea')).some(
      (field) => field.value !== '' || field === document.activeElement,
    );
    if (typing) {
      let notice = document.getElementById('live-notice');
      if (!notice) {
        notice = document.createElement('p');
        notice.id = 'live-notice';
        notice.className = 'notice';
        notice.setAttribute('role', 'status');
        notice.textContent = 'This page has changed. Reload it to see the changes.';
        main.prepend(notice);
      }
      return;
    }
    const response = await fetch(window.location.href, { credentials: 'same-origin' });
    if (!response.ok) return;
    const fresh = new DOMParser().parseFromString(await response.text(), 'text/html').querySelector('main');
    if (fresh) {
      main.replaceChildren(...fresh.childNodes);
      afterRefresh();
    }
  }

  const live = main.dataset.live;
  if (live && window.EventSource) {
    const source = new EventSource(live);
    source.addEventListener('changed', () => refresh());
    // The model's text as it is written, appended as text (never markup) to the answer being
    // written; the next refresh replaces it with the server's rendering.
    source.addEventListener('text', (event) => {
      let data;
      try {
        data = JSON.parse(event.data);
      } catch {
        return;
      }
      const answer = document.getElementById('answer-' + data.run);
      if (answer && answer.classList.contains('streaming') && typeof data.delta === 'string') {
        answer.textContent += data.delta;
      }
    });
    source.addEventListener('end', () => {
      source.close();
      refresh();
    });
  }

  if (!main.classList.contains('inbox')) return;
  // The held call selected, by its approval's id, never by its place in the list: a refresh
  // that adds or removes calls moves the cards, and a shortcut must still act on the one the
  // person chose, or on none once it has gone.
  let selected = null;
  const cards = () => Array.from(main.querySelectorAll('section.card'));
  const selectedCard = () => cards().find((card) => card.dataset.approval === selected);
  function focusCard(index) {
    const all = cards();
    if (all.length === 0) return;
    const card = all[Math.max(0, Math.min(index, all.length - 1))];
    selected = card.dataset.approval;
    card.focus();
  }
  function move(step) {
    const index = cards().indexOf(selectedCard());
    focusCard(index < 0 ? 0 : index + step);
  }
  afterRefresh = () => {
    const card = selectedCard();
    if (card) card.focus();
    else selected = null;
  };
  function decide(verdict) {
    const card = selectedCard();
    const form = card && card.querySelector('form.decide');
    if (!form) return;
    const reason = form.querySelector('input[name=reason]');
    form.dataset.intent = verdict;
    if (reason.value.trim() === '') {
      reason.focus();
      return;
    }
    form.querySelector(verdict === 'deny' ? 'button.deny' : 'button.approve').click();
  }
  document.addEventListener('keydown', (event) => {
    const target = event.target;
    if (target instanceof HTMLInputElement && target.name === 'reason' && event.key === 'Enter') {
      // Enter in a reason field carries out the decision its card's shortcut chose.
      const form = target.form;
      if (form && form.dataset.intent === 'deny' && target.value.trim() !== '') {
        event.preventDefault();
        form.querySelector('button.deny').click();
      }
      return;
    }
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    if (target instanceof HTMLInputElement || target instanceof HTMLTextAreaElement || target instanceof HTMLSelectElement) return;
    if (cards().includes(document.activeElement)) selected = document.activeElement.dataset.approval;
    if (event.key === 'j') move(1);
    else if (event.key === 'k') move(-1);
    else if (event.key === 'a') decide('approve');
    else if (event.key === 'd') decide('deny');
    else return;
    event.preventDefault();
  });
})();
